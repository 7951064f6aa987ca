"""Delivery of the buckets that are not suspects: new events past their cursors, and parked keys whose
retry is due (runner thread)."""

from __future__ import annotations

import time

from psycopg_pool import ConnectionPool

from .. import store
from ..sinks.engine import Sink
from ..store import Conn
from .batch import Batches
from .checkpoints import CheckpointWriter
from .cursors import CursorBook
from .hints import Hints
from .hooks import Hooks
from .leases import Losses
from .parked import PARK_CHECK_IDLE_SECONDS, ParkSchedule
from .reads import ReadPlan, fetch_events

PARKED_KEYS_PER_PASS = 256
PARKED_PER_KEY = 100


class Delivery:
    def __init__(self, sink: Sink, worker: str, pool: ConnectionPool[Conn], *, book: CursorBook, reads: ReadPlan,
                 writer: CheckpointWriter, batches: Batches, losses: Losses, hints: Hints, park: ParkSchedule,
                 hooks: Hooks) -> None:
        self.sink = sink
        self.worker = worker
        self.pool = pool
        self.book = book
        self.reads = reads
        self.writer = writer
        self.batches = batches
        self.losses = losses
        self.hints = hints
        self.park = park
        self.hooks = hooks

    def deliver_new(self, held: dict[int, int]) -> int:
        # The previous batch's fence check, if it waits (``BatchCommit.later``): this read does it. A read
        # that fails puts it back.
        pending = self.writer.take_pending()
        # Read the buckets notifications named (and those whose last read was full); every held bucket
        # now and then, and always while notifications do not reach this relay. The waiting batch's other
        # buckets are only checked (limit 0: their fence, not their delta).
        hinted = self.hints.take()
        now = time.monotonic()
        checks: set[int] = set()
        plan = self.reads
        if hinted is None or now >= plan.full_read_at or not self.hooks.listening():
            plan.full_read_at = now + self.hooks.idle_poll()
        else:
            wanted = {b: held[b] for b in (hinted | plan.saturated) & held.keys()}
            if pending is not None:
                checks = {b for b in pending.fences if b in held and b not in wanted}
            if not wanted and (not checks or not self.hooks.defer_writes()):
                # Nothing to read. While nothing holds vacuum back, a waiting fence check is not a read of its
                # own either: it rides on the next read or on the write of its cursors, within a second
                # (``CheckpointWriter.until_flush``, ``flush_owed``).
                self.writer.put_back(pending)
                return 0
            held = {**wanted, **{b: held[b] for b in checks}}
        try:
            with self.pool.connection() as conn:
                if not self.writer.same_server(conn):
                    pending = None  # its cursors were dropped with the others: its events are read again
                limits = plan.limits({b: f for b, f in held.items() if b not in checks})
                reads = {b: (limit, self.book.read_cursor(b)) for b, limit in limits.items()}
                reads.update((b, (0, self.book.read_cursor(b))) for b in checks)
                read_at = time.monotonic()
                read = fetch_events(conn, self.sink, self.worker, reads, fences=held)
        except BaseException:
            if pending is not None:
                self.writer.put_back(pending)
            raise
        if pending is not None:  # landed where the read found the fence held, before the read moves cursors
            pending.landed_at = read.checked_at
            self.writer.landed(pending, set(pending.fences) & read.held)
        lost = reads.keys() - read.held
        if lost:  # fenced out (a new owner or fence, or the lease ran out): nothing of them was read
            self.losses.lose(lost, held)
        plan.snapshots.taken(read.now, read_at)
        # A delta: not visible in the cursor's snapshot, so committed after it was taken (once per bucket).
        unseen = {b: plan.snapshots.at(cursor.seen) for b, (_, cursor) in reads.items()}
        for e in read.events:
            e.unseen_at = unseen[e.bucket]
        by_bucket = read.by_bucket()
        # Read again next cycle, whatever the hints say: buckets whose read was full, and buckets read in
        # pages against an older snapshot (their cursor's target). A commit after that target is not in
        # those pages, and its wake-up may have been used up by one of them.
        plan.saturated = {b for b, evs in by_bucket.items() if len(evs) >= reads[b][0]} | {
            b for b, (_, cursor) in reads.items() if cursor.target is not None and b in read.held}
        for b, (limit, cursor) in reads.items():
            # An empty delta (or only events the sink does not want): move on. Not a bucket only checked.
            if b not in by_bucket and b in read.held and limit:
                self.book.passed_empty(b, cursor.after_read(read.now, None, full=False), cursor)
        if not read.events:
            return 0
        advance = {b: reads[b][1].after_read(read.now, evs[-1].position, full=len(evs) >= reads[b][0])
                   for b, evs in by_bucket.items()}
        if any(e.blocked for e in read.events):
            self.park.now()
        fences = {b: held[b] for b in advance}
        self.book.number_read(read.events, fences)
        self.batches.run(read.events, fences, advance, resets=set(fences))
        return len(read.events)

    def retry_parked(self, held: dict[int, int]) -> int:
        with self.pool.connection() as conn:
            events = store.fetch_parked(conn, self.sink.name, list(held), PARKED_KEYS_PER_PASS, PARKED_PER_KEY,
                                        worker=self.worker, fences=held)
            if not events:
                # Nothing due: look again when the next retry is (the idle wait ends then too).
                due_in = store.next_parked_retry(conn, self.sink.name, list(held))
                if due_in is None:  # nothing parked: whatever parks an event says so (PARK_CHECK_IDLE_SECONDS)
                    due_in = PARK_CHECK_IDLE_SECONDS if self.hooks.listening() else self.hooks.idle_poll()
                self.park.after(due_in)
                return 0
        fences = {e.bucket: held[e.bucket] for e in events}
        self.book.number_read(events, fences)
        self.batches.run(events, fences, {}, resets=set(fences))
        return len(events)
