"""What a projection handler receives: the event, its fencing token, and whether it is a replay."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

P = TypeVar("P")


@dataclass(frozen=True, order=True)
class FenceToken:
    """Orders the writes of one partition key in the order the relay delivers them:
    (bucket fence, read, xid, seq).

    - ``fence`` grows with every acquisition of the key's bucket (a change of owner, or the same
      relay taking it up again), so every token of a newer owner is larger, and a write from a
      worker that lost its lease carries a smaller token than its successor's.
    - ``read`` numbers the reads of the bucket under that fence (1, 2, ...; the relay counts them in
      memory): every page of new events and every fetch of parked retries is a new read, and so is
      reading a batch again after it failed. A bucket's batches go out one after another in the
      order they were read.
    - ``(xid, seq)``: the order within one read, which is the order a read delivers one key's events
      in (a delta in (xid, seq) order; parked events per key in (xid, seq) order).

    So a larger token is a later delivery of the key, even where delivery order is not ``(xid,
    seq)`` order (overlapping transactions of one key: docs/design-read-path.md, "What order one key
    gets"). An event delivered again gets a new, larger token than its first delivery.

    ``read`` 0: not from a relay's read. A key rebuild (``rebuild --key``) replays under the live
    cursor's fence with read 0, so in a store outside the transaction it never outranks what live
    processing wrote under that fence; tokens written before reads were numbered (the three-part
    ``FENCE-XID-SEQ``) parse with read 0.

    ``str(token)`` is the four numbers zero-padded to 20 digits and joined by ``-``; it sorts like
    the token, for stores that only compare strings. A stored old three-part string never outranks
    a new four-part one of the same key: both start with the 20-digit fence, and a relay of this
    version writes only under a fence it acquired itself, and every acquisition sets the bucket's
    fence to one more than any fence issued for it before (``acquire_leases`` in
    sql/queries/membership.sql), so above the fence of every token an older relay wrote. Equal
    fences can not meet across versions: one fence is one acquisition by one process. (Not across
    a sink dropped and recreated: its new cursors start from fence 0 again.)
    """

    fence: int
    read: int
    xid: int
    seq: int

    def __str__(self) -> str:
        return f"{self.fence:020d}-{self.read:020d}-{self.xid:020d}-{self.seq:020d}"

    @classmethod
    def parse(cls, text: str) -> FenceToken:
        """A token from ``str(token)``: ``FENCE-READ-XID-SEQ``, or the older ``FENCE-XID-SEQ`` (read 0)."""
        parts = text.split("-") if isinstance(text, str) else []
        if len(parts) not in (3, 4) or not all(p.isascii() and p.isdigit() for p in parts):
            raise ValueError(f"not a fence token: {text!r} (expected FENCE-READ-XID-SEQ, or FENCE-XID-SEQ as "
                             "written before reads were numbered: non-negative integers joined by '-')")
        numbers = [int(p) for p in parts]
        if len(numbers) == 3:
            numbers.insert(1, 0)
        fence, read, xid, seq = numbers
        return cls(fence, read, xid, seq)


@dataclass(frozen=True)
class ProjectionEvent(Generic[P]):
    """One event as a handler sees it. ``payload`` is the decoded JSON, or the pydantic model
    declared for the event's type."""

    id: uuid.UUID
    type: str
    key: str
    topic: str | None
    payload: P
    headers: dict[str, str]
    time: datetime
    # (xid, seq): where the event is stored. Publish order within its transaction; across
    # transactions of one key not always the delivery order (``token`` follows that).
    position: tuple[int, int]
    token: FenceToken
    attempt: int  # 1 on first delivery
    replay: bool  # True while a rebuild replays history
    version: int = 1  # the payload's schema version, after upcasting (the type's current one)

    @property
    def fence(self) -> int:
        return self.token.fence


# A relay builds one ProjectionEvent and one FenceToken per event it hands over (a rebuild, every
# stored event). A frozen dataclass's __init__ sets each field through object.__setattr__; setting
# the instance's __dict__ at once gives the same object at a third of the cost. Every field is set
# here (test_event_decoding checks the result equals the plain constructor's).
_new = object.__new__
_set = object.__setattr__


def make_token(fence: int, read: int, xid: int, seq: int) -> FenceToken:
    """``FenceToken(fence, read, xid, seq)``, faster."""
    token = _new(FenceToken)
    _set(token, "__dict__", {"fence": fence, "read": read, "xid": xid, "seq": seq})
    return token


def make_event(id: uuid.UUID, type: str, key: str, topic: str | None, payload: P, headers: dict[str, str],
               time: datetime, position: tuple[int, int], token: FenceToken, attempt: int, replay: bool,
               version: int) -> ProjectionEvent[P]:
    """``ProjectionEvent(...)`` with every field given, faster."""
    event: ProjectionEvent[P] = _new(ProjectionEvent)
    _set(event, "__dict__", {"id": id, "type": type, "key": key, "topic": topic, "payload": payload,
                             "headers": headers, "time": time, "position": position, "token": token,
                             "attempt": attempt, "replay": replay, "version": version})
    return event
