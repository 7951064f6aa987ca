"""Where a sink is in a bucket, and what it reads next: the pure part of the read path.

Events are read in the order their transactions became visible, PgQ-style. A sink's cursor in a
bucket is a snapshot, ``seen``: every event whose transaction is visible in it has been delivered.
The next read is the *delta*: events whose transaction is visible now and was not in ``seen``,
i.e. its transaction id is at or above ``seen.xmax``, or was in ``seen.xip`` (still open then) and
has committed since. So a transaction that commits late is read when it commits (never skipped),
and one that stays open holds nothing back: it is simply in the next delta's ``xip`` again.

Within a delta events go in (xid, seq) order. A delta bigger than one batch is read in pages from a
pinned ``target`` snapshot, ``after`` the last event delivered, so that a transaction that commits
meanwhile waits for the next delta instead of slipping in before events that became visible first.
Once the pages are done, ``seen`` becomes the target.

Per key this is the order in which transactions became visible; transactions of one key that
became visible between the same two reads go in transaction-id order.
"""

from __future__ import annotations

from dataclasses import dataclass

Position = tuple[int, int]  # (xid, seq) of one event


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A PostgreSQL ``pg_snapshot``: transactions below ``xmin`` have ended, those at or above ``xmax``
    had not started, and of those between, the ones in ``xip`` were still in progress."""

    xmin: int
    xmax: int
    xip: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, text: str) -> Snapshot:
        xmin, xmax, xip = text.split(":")
        return cls(int(xmin), int(xmax), frozenset(int(x) for x in xip.split(",") if x))

    def __str__(self) -> str:
        return f"{self.xmin}:{self.xmax}:{','.join(str(x) for x in sorted(self.xip))}"

    def visible(self, xid: int) -> bool:
        """Whether the transaction ``xid`` had ended when the snapshot was taken (pg_visible_in_snapshot)."""
        return xid < self.xmin or (xid < self.xmax and xid not in self.xip)


# Before the first event: nothing is visible in it (transaction ids start at 3).
ORIGIN = Snapshot(1, 1)


@dataclass(frozen=True, slots=True)
class Cursor:
    """What a sink has delivered in one bucket (see the module docstring)."""

    seen: Snapshot
    target: Snapshot | None = None  # pinned while a delta is read in pages
    after: Position | None = None  # the last event delivered from the target's delta

    @classmethod
    def at(cls, position: Position) -> Cursor:
        """Everything up to ``position`` in (xid, seq) order: the cursor of a rebuild that starts there."""
        xid, seq = position
        if xid < ORIGIN.xmax:
            return cls(ORIGIN)
        return cls(Snapshot(xid, xid), Snapshot(xid + 1, xid + 1), (xid, seq - 1))

    def delivered(self, xid: int, seq: int) -> bool:
        if self.seen.visible(xid):
            return True
        return (self.target is not None and self.after is not None and self.target.visible(xid)
                and (xid, seq) <= self.after)

    def read_from(self, now: Snapshot) -> Snapshot:
        """The snapshot the next delta comes from."""
        return self.target if self.target is not None else now

    def after_read(self, now: Snapshot, last: Position | None, full: bool) -> Cursor:
        """The cursor once a read from ``now`` has been delivered: ``last`` is the last event it
        returned, ``full`` whether it returned as many as asked (so that there may be more)."""
        target = self.read_from(now)
        if full and last is not None:
            return Cursor(self.seen, target, last)
        return Cursor(target)

    def params(self) -> tuple[str, str | None, str | None, int | None]:
        """As the read and checkpoint queries take it: seen, target, after xid, after seq (text for xid8)."""
        return (str(self.seen), str(self.target) if self.target is not None else None,
                str(self.after[0]) if self.after is not None else None,
                self.after[1] if self.after is not None else None)

    @classmethod
    def from_row(cls, seen: str, target: str | None, after_xid: int | str | None, after_seq: int | None) -> Cursor:
        return cls(Snapshot.parse(seen), Snapshot.parse(target) if target is not None else None,
                   (int(after_xid), int(after_seq)) if after_xid is not None and after_seq is not None else None)
