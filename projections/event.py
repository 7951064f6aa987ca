"""What a projection handler receives: the event, its fencing token, and whether it is a replay."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

P = TypeVar("P")


@dataclass(frozen=True, order=True)
class FenceToken:
    """Orders the writes of one partition key across owners: (bucket fence, xid, seq).

    The fence grows with every change of a bucket's owner and the position grows with
    publish order, so a write carrying a larger token is newer, and a write from a worker
    that lost its lease carries a smaller one than its successor's. ``str(token)`` sorts
    the same way as the tuple (zero-padded), for stores that only compare strings.
    """

    fence: int
    xid: int
    seq: int

    def __str__(self) -> str:
        return f"{self.fence:020d}-{self.xid:020d}-{self.seq:020d}"

    @classmethod
    def parse(cls, text: str) -> FenceToken:
        fence, xid, seq = (int(part) for part in text.split("-"))
        return cls(fence, xid, seq)


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
    position: tuple[int, int]  # (xid, seq): publish order per key
    token: FenceToken
    attempt: int  # 1 on first delivery
    replay: bool  # True while a rebuild replays history

    @property
    def fence(self) -> int:
        return self.token.fence
