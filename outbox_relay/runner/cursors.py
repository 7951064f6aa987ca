"""The cursor book: where each held bucket's reading stands and which cursor writes are due (runner
thread only). Pure: no I/O, times passed in, so that what is written when can be tested alone.

Every write of a cursor row leaves a dead row version, and while a long transaction anywhere on the
server holds vacuum back none of them can be removed: a write per bucket per batch piled up tens of
thousands in outbox.cursors (issue 16). A sink without a transaction of its own (Kafka) has delivered
before its checkpoint, so writing its cursor later only means more redelivery after a crash, never a
loss or a reorder: its batches check their fence without writing (a read). While a long transaction
holds vacuum back (``held``), a bucket's cursor is written at most once per ``cursor_flush_seconds``;
otherwise a write leaves no lasting dead row but still costs a statement and a commit, about as much
as the batch's read (bench/results/2026-12-03-cost-per-event.md), so a busy runner writes its cursors
together at most once per ``BUSY_FLUSH_SECONDS``, and a batch after a quiet spell writes at once. Both
also when a lease is handed back. A projection's checkpoint commits with its read-model writes (G7) and
is never deferred.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..positions import Cursor
from ..store import Acquired, Checkpoint, StoredEvent

# How often read cursors that passed only empty deltas are written. A sink that gets every event (Kafka)
# passes no event that way, so a next owner rereads nothing by their lag: once a minute (and on release).
# A sink that filters (a projection) passes events it skips, which retention waits for: every 5 heartbeats.
AHEAD_FLUSH_UNFILTERED_SECONDS = 60.0
# While a runner is busy, deferred cursor writes that are due wait until the oldest is this much overdue
# (at most ``cursor_flush_seconds``), so that they go out together about once a second rather than as a
# statement in most cycles: a Kafka batch defers its due writes too (``BatchCommit.later``).
OWED_BUSY_SLACK_SECONDS = 1.0
# While nothing holds vacuum back: a runner's cursor writes go out together at most this often (one
# statement for every bucket moved since), at most ``cursor_flush_seconds``. After a crash or a lost
# lease, a next owner resends up to this much of acknowledged events (in order).
BUSY_FLUSH_SECONDS = 1.0


class CursorBook:
    def __init__(self, flush_seconds: float, ahead_flush_seconds: float, now: float) -> None:
        self.flush_seconds = flush_seconds  # cursor_flush_seconds: 0 writes every cursor at once
        self.ahead_flush_seconds = ahead_flush_seconds
        self.cursors: dict[int, Cursor] = {}  # held bucket -> its cursor as written in outbox.cursors
        # Held buckets whose read cursor is ahead of the stored one: it passed an empty delta (nothing to
        # deliver there), or a delivered batch whose cursor write was deferred (``owed``). Written with
        # the next written checkpoint of the bucket, or when they are due (``owed_due``, ``ahead_due``).
        self.ahead: dict[int, Cursor] = {}
        self.flushed_at = now  # when the ahead cursors were last written (monotonic)
        self.wrote_at = float("-inf")  # when the runner last wrote a cursor row (any bucket; monotonic)
        # Held bucket -> monotonic time its cursor row was last written (or acquired); held buckets whose
        # ``ahead`` cursor passed delivered events that are not written yet; held buckets acquired with
        # lapses counted, written at once until a reset lands.
        self.written_at: dict[int, float] = {}
        self.owed: set[int] = set()
        self._owed_oldest: float | None = None  # min of ``written_at`` over ``owed``; None: to be computed
        self.lapsed: set[int] = set()
        # Held bucket -> (fence, reads of it numbered under that fence): see ``number_read``.
        self._reads: dict[int, tuple[int, int]] = {}

    def read_cursor(self, bucket: int) -> Cursor:
        return self.ahead.get(bucket) or self.cursors[bucket]

    def forget(self, held: dict[int, int]) -> None:
        """Drop what is kept of buckets no longer held."""
        for b in set(self.cursors) - held.keys():
            del self.cursors[b]
            self.ahead.pop(b, None)
            self.written_at.pop(b, None)
            self.owed.discard(b)
            self._owed_oldest = None
            self.lapsed.discard(b)
        for b in set(self._reads) - held.keys():
            del self._reads[b]

    def acquired(self, acquired: dict[int, Acquired], now: float) -> None:
        """Buckets just acquired: their cursors as the acquisition wrote them."""
        self.cursors.update({b: a.cursor for b, a in acquired.items()})
        for b, a in acquired.items():
            self.ahead.pop(b, None)
            self.owed.discard(b)
            self._owed_oldest = None
            self.written_at[b] = now
            if a.lapses:
                self.lapsed.add(b)
            else:
                self.lapsed.discard(b)

    def number_read(self, events: Sequence[StoredEvent], fences: dict[int, int]) -> None:
        """Stamp the events of one read (a page of new events, or a fetch of parked ones) with their
        bucket's next read number under its fence: the ``read`` of their projection fence tokens
        (projections/event.py), numbered from 1 again under each new fence.

        A bucket's batches go out one after another in the order they were read, and one read gives
        each key's events in (xid, seq) order, so (fence, read, xid, seq) grows in delivery order per
        key, also where that is not (xid, seq) order, and for a batch read again after it failed."""
        numbered: dict[int, int] = {}
        for e in events:
            n = numbered.get(e.bucket)
            if n is None:
                fence = fences[e.bucket]
                last_fence, last = self._reads.get(e.bucket, (fence, 0))
                n = numbered[e.bucket] = last + 1 if last_fence == fence else 1
                self._reads[e.bucket] = (fence, n)
            e.read = n

    def passed_empty(self, bucket: int, moved: Cursor, cursor: Cursor) -> None:
        """A read of ``bucket`` from ``cursor`` found nothing to deliver: its read cursor moves on."""
        if moved != cursor:
            self.ahead[bucket] = moved

    def _must_write(self, cp: Checkpoint, bucket: int, suspect: Callable[[int], bool]) -> bool:
        # A crash-loop suspect's progress is what its isolation counts on; a lapse count is reset only by
        # a write.
        return suspect(bucket) or (bucket in cp.resets and bucket in self.lapsed)

    def busy_every(self) -> float:
        """While nothing holds vacuum back: the shortest time between two of the runner's cursor writes."""
        return min(self.flush_seconds, BUSY_FLUSH_SECONDS)

    def deferrable(self, cp: Checkpoint, suspect: Callable[[int], bool], held: bool, now: float) -> set[int]:
        """The buckets of a sink-less-transaction batch checkpoint whose cursor write can wait. ``held``:
        whether a long transaction holds vacuum back now (then per bucket, else per runner)."""
        every = self.flush_seconds
        if every <= 0 or not cp.moves_only:
            return set()
        if not held:
            if now - self.wrote_at >= self.busy_every():
                return set()
            return {b for b in cp.advance if not self._must_write(cp, b, suspect)}
        return {b for b in cp.advance
                if not self._must_write(cp, b, suspect) and now - self.written_at.get(b, -every) < every}

    def foldable(self, cp: Checkpoint, suspect: Callable[[int], bool], held: bool, now: float) -> bool:
        """Whether a delivered batch's checkpoint may wait for the runner's next read (``BatchCommit.later``):
        it only moves cursors, one per bucket it read past, and each of them may be written later (as in
        ``deferrable``, except that while ``held`` a write that is due waits for ``owed_due`` too)."""
        if self.flush_seconds <= 0 or not cp.moves_only or cp.advance.keys() != cp.fences.keys():
            return False
        if not held and now - self.wrote_at >= self.busy_every():
            return False
        return not any(self._must_write(cp, b, suspect) for b in cp.fences)

    def fold(self, cp: Checkpoint) -> None:
        """A batch whose fence check waits for the next read: that read goes on from after it."""
        self.ahead.update(cp.advance)

    def until_owed_flush(self, held: bool, now: float) -> float:
        """Seconds until the deferred cursor writes are due (inf: none is owed)."""
        if not self.owed:
            return float("inf")
        return self.until_busy_flush(now) if not held else self._until_held_flush(now)

    def until_busy_flush(self, now: float) -> float:
        """While nothing holds vacuum back: seconds until the runner's next cursor write may go out."""
        return self.wrote_at + self.busy_every() - now

    def _until_held_flush(self, now: float) -> float:
        if self._owed_oldest is None:  # once per write of an owed cursor, not per cycle
            self._owed_oldest = min(self.written_at.get(b, 0.0) for b in self.owed)
        return self._owed_oldest + self.flush_seconds - now

    def owed_slack(self) -> float:
        return min(OWED_BUSY_SLACK_SECONDS, self.flush_seconds)

    def ahead_due(self, now: float) -> bool:
        return bool(self.ahead) and now - self.flushed_at >= self.ahead_flush_seconds

    def owed_due_now(self, busy: bool, held: bool, now: float) -> bool:
        """Whether the deferred writes go out this cycle: once due (while ``held``, a little past due if busy)."""
        slack = self.owed_slack() if busy and held else 0.0
        return bool(self.owed) and self.until_owed_flush(held, now) <= -slack

    def ahead_in(self, held: dict[int, int]) -> dict[int, Cursor]:
        return {b: c for b, c in self.ahead.items() if b in held}

    def owed_due(self, buckets: dict[int, int], held: bool, now: float) -> dict[int, Cursor]:
        """The deferred cursors of ``buckets`` that are due: while ``held``, those written longest ago;
        otherwise all of them (one write per ``busy_every``)."""
        return {b: self.ahead[b] for b in self.owed
                if b in buckets and b in self.ahead and (not held or now - self.written_at.get(b, 0.0)
                                                         >= self.flush_seconds)}

    def landed(self, cp: Checkpoint, ok: set[int], now: float) -> None:
        """``cp`` landed in ``ok``: its cursors are written, or fenced and owed."""
        for b, cursor in cp.advance.items():
            if b not in ok:
                continue
            if b in cp.defer:  # fenced, not written: the read cursor moves, the row waits (``owed_due``)
                self.ahead[b] = cursor
                if b not in self.owed and self._owed_oldest is not None:
                    self._owed_oldest = min(self._owed_oldest, self.written_at.get(b, 0.0))
                self.owed.add(b)
            else:
                self.cursors[b] = cursor
                self.ahead.pop(b, None)
                self.owed.discard(b)
                self._owed_oldest = None
                self.written_at[b] = now
                self.wrote_at = now
        self.lapsed -= (cp.resets & ok) - cp.defer  # their lapses are 0 in the row now

    def drop_unwritten(self) -> int:
        """The server restarted: forget the cursors held only here (read again from the written ones).
        Returns how many buckets were ahead."""
        ahead = len(self.ahead)
        self.ahead.clear()
        self.owed.clear()
        self._owed_oldest = None
        return ahead
