"""The check itself, sans IO: what a sink should have received against what a reader got back.

``Check`` takes what was read back (``Received``, in the broker's order per destination) up front,
then the stored history one bucket at a time (``Stored``, each key's events in position order), and
``finish()`` returns the ``Report``. Per stored event, what the sink's own records say of it:

- ``delivered``: behind the sink's cursor, not parked, not dead-lettered. Missing from what was read
  back: **lost**.
- ``pending``: past the cursor, or parked (retrying, paused): **not yet delivered**, never lost; read
  back anyway is fine (a Kafka sink writes its cursor after the acknowledgement, at most every
  --cursor-flush-seconds).
- ``dead``: dead-lettered (or skipped by an operator): not lost.
- ``unrouted``: of a topic the sink does not read; read back, it is a **phantom** like an id that was
  never stored.

Per destination and key, the first copy of each event must come in position order (G6): an event
that comes after one of a later position is **reordered**, unless the two are of different
transactions that may have overlapped (the earlier position's transaction committed after the later
one began: docs/guarantees.md, "The order one key gets"), which is counted apart and allowed. Without
commit times (``track_commit_timestamp`` off) no overlap is known and every inversion counts.
Further copies are **duplicates**: allowed (at-least-once), counted.

A read-back id that is not in stored history is a phantom, unless retention removed history of the
sink's topics: then it may be an older event and is counted **not checkable**.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

STATES = ("delivered", "pending", "dead", "unrouted")
SAMPLE = 10  # offending keys (and phantoms) the report names by default


@dataclass(frozen=True)
class Received:
    """One message read back: the event id it carries, its partition key, where it was read."""

    id: uuid.UUID
    key: str
    destination: str


@dataclass(frozen=True)
class Stored:
    """One stored event, and what the sink's records say of it (``STATES``)."""

    id: uuid.UUID
    key: str
    xid: int
    seq: int
    state: str
    started_at: datetime | None = None  # its transaction's start (created_at)
    committed_at: datetime | None = None  # its transaction's commit (None: not known)


@dataclass(frozen=True)
class Lost:
    key: str
    event_ids: list[uuid.UUID]  # the key's lost events, in position order (the first few)
    count: int


@dataclass(frozen=True)
class Reordered:
    key: str
    destination: str
    came_first: uuid.UUID  # read back before ...
    came_after: uuid.UUID  # ... this event of an earlier position
    count: int  # the key's events read back out of order in this destination


@dataclass(frozen=True)
class Phantom:
    id: uuid.UUID
    key: str
    destination: str
    reason: str


@dataclass
class Report:
    sink: str
    kind: str
    checks: str  # what this kind of sink lets verify check (readers.describe)
    stored: int = 0  # stored events of the sink's topics
    delivered: int = 0  # of them behind its cursor (should have been read back)
    pending: int = 0  # not yet delivered (past the cursor, parked)
    dead_lettered: int = 0
    received: int = 0  # messages read back
    distinct: int = 0  # distinct event ids among them
    lost: int = 0
    reordered: int = 0  # events read back out of order
    overlapping: int = 0  # inversions of transactions that may have overlapped (allowed)
    phantoms: int = 0  # events (distinct ids) read back that the sink should never have had
    duplicates: int = 0  # copies beyond the first (allowed)
    dead_read_back: int = 0  # dead-lettered events that were read back all the same
    not_checkable: int = 0  # read-back ids older than retention may have kept
    removed_by_retention: int = 0  # events of the sink's topics retention removed
    removed_through: datetime | None = None
    lost_keys: list[Lost] = field(default_factory=list)
    reordered_keys: list[Reordered] = field(default_factory=list)
    phantom_events: list[Phantom] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No loss, no reorder, no phantom (duplicates are allowed)."""
        return not (self.lost or self.reordered or self.phantoms)


class Check:
    """One verification: ``add`` every bucket's stored events, then ``finish``."""

    def __init__(self, report: Report, received: Iterable[Received] | None, *, sample: int = SAMPLE) -> None:
        self.report = report
        self.sample = sample
        # None: the sink can not be read back (a projection): nothing counts as lost, no order is known.
        self.read_back = received is not None
        # Every copy's place in the read-back order, per event id.
        self._places: dict[uuid.UUID, list[tuple[int, Received]]] = {}
        count = 0
        for place, r in enumerate(received or ()):
            self._places.setdefault(r.id, []).append((place, r))
            count += 1
        report.received = count
        report.distinct = len(self._places)
        report.duplicates = count - len(self._places)
        self._stored: set[uuid.UUID] = set()  # read-back ids found in stored history
        self._reordered_keys = 0

    def add(self, events: Iterable[Stored]) -> None:
        """Stored events of whole keys (a bucket's), each key's in position order."""
        by_key: dict[str, list[Stored]] = {}
        for e in events:
            by_key.setdefault(e.key, []).append(e)
        for key, stored in by_key.items():
            self._key(key, stored)

    def _key(self, key: str, events: Sequence[Stored]) -> None:
        r = self.report
        lost: list[uuid.UUID] = []
        # destination -> [(place of the first copy, event)]
        firsts: dict[str, list[tuple[int, Stored]]] = {}
        for e in events:
            places = self._places.get(e.id)
            if places is not None:
                self._stored.add(e.id)
            if e.state == "unrouted":
                if places:
                    self._phantom(places[0][1], "stored, but of a topic this sink does not read")
                continue
            r.stored += 1
            if e.state == "delivered":
                r.delivered += 1
                if not places and self.read_back:
                    lost.append(e.id)
            elif e.state == "pending":
                r.pending += 1
            else:
                r.dead_lettered += 1
                if places:
                    r.dead_read_back += 1
            seen: set[str] = set()
            for place, got in places or ():
                if got.destination not in seen:
                    seen.add(got.destination)
                    firsts.setdefault(got.destination, []).append((place, e))
        if lost:
            r.lost += len(lost)
            if len(r.lost_keys) < self.sample:
                r.lost_keys.append(Lost(key, lost[:self.sample], len(lost)))
        for destination, placed in firsts.items():
            self._order(key, destination, placed)

    def _order(self, key: str, destination: str, placed: list[tuple[int, Stored]]) -> None:
        """Each event against the latest position read back before it in this destination."""
        placed.sort(key=lambda p: p[0])
        latest: Stored | None = None
        first: tuple[uuid.UUID, uuid.UUID] | None = None
        count = 0
        for _, e in placed:
            if latest is None or (e.xid, e.seq) > (latest.xid, latest.seq):
                latest = e
                continue
            if may_overlap(e, latest):
                self.report.overlapping += 1
                continue
            count += 1
            first = first or (latest.id, e.id)
        if first is not None:
            self.report.reordered += count
            if len(self.report.reordered_keys) < self.sample:
                self.report.reordered_keys.append(Reordered(key, destination, first[0], first[1], count))

    def _phantom(self, got: Received, reason: str) -> None:
        self.report.phantoms += 1
        if len(self.report.phantom_events) < self.sample:
            self.report.phantom_events.append(Phantom(got.id, got.key, got.destination, reason))

    def unmatched(self) -> list[uuid.UUID]:
        """Read-back ids not found in the stored history added so far."""
        return [event_id for event_id in self._places if event_id not in self._stored]

    def finish(self, stored_later: Iterable[uuid.UUID] = ()) -> Report:
        """The report, once every bucket was added. ``stored_later``: read-back ids not in the history
        added but stored since (committed after the history was read): not yet delivered, not phantoms."""
        r = self.report
        later = set(stored_later)
        for event_id in self.unmatched():
            if event_id in later:
                r.pending += 1
                continue
            if r.removed_by_retention:
                r.not_checkable += 1
                continue
            self._phantom(self._places[event_id][0][1], "no stored event has this id")
        if r.not_checkable:
            r.notes.append(f"{r.not_checkable} events read back are not in stored history: retention removed "
                           f"{r.removed_by_retention} events of this sink's topics, they may be among them")
        return r


def may_overlap(earlier: Stored, later: Stored) -> bool:
    """Whether the transaction of ``earlier`` (the smaller position) may have committed after the one of
    ``later`` began, so that a sink may get them in either order (docs/guarantees.md)."""
    if earlier.xid == later.xid:
        return False  # one transaction: its events come in seq order, always
    if earlier.committed_at is None or later.started_at is None:
        return False  # not known: counted as reordered (the report says how to tell)
    return earlier.committed_at > later.started_at
