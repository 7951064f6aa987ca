"""Crash-loop isolation: a suspect bucket is delivered a few events at a time, its first event alone with
its attempt counted before it is made, so that what kills the process is charged to the event that did
(runner thread). ``ramp.py`` holds who is a suspect; this acts on it."""

from __future__ import annotations

import logging

from psycopg_pool import ConnectionPool

from .. import store
from ..backoff import Backoff
from ..crashloop import FIRST_PROBE, HEALTHY, next_probe_size
from ..dsn import describe_error
from ..positions import Cursor
from ..settings import RelaySettings
from ..sinks.engine import Sink
from ..store import Checkpoint, Conn
from .batch import Batches
from .checkpoints import CheckpointWriter
from .cursors import CursorBook
from .leases import Losses
from .outcomes import CRASH_ERROR, points_at_events
from .ramp import Ramp
from .reads import ReadPlan, fetch_events

log = logging.getLogger("outbox_relay.relay")  # every part of the runner logs as the relay

# Steps of one probe that deliver nothing (queueing behind a parked key, dead-lettering an
# exhausted event) before it gives the loop back.
PROBE_QUIET_STEPS = 100


class CrashLoopProber:
    def __init__(self, sink: Sink, worker: str, pool: ConnectionPool[Conn], settings: RelaySettings, *,
                 ramp: Ramp, book: CursorBook, reads: ReadPlan, writer: CheckpointWriter, batches: Batches,
                 losses: Losses, backoff: Backoff) -> None:
        self.sink = sink
        self.worker = worker
        self.pool = pool
        self.settings = settings
        self.ramp = ramp
        self.book = book
        self.reads = reads
        self.writer = writer
        self.batches = batches
        self.losses = losses
        self.backoff = backoff

    def probe(self, bucket: int, fence: int, held: int) -> int:
        size = self.ramp.size(bucket)
        if size == FIRST_PROBE:
            return self._probe_alone(bucket, fence)
        cursor = self.book.read_cursor(bucket)
        with self.pool.connection() as conn:
            parked = store.fetch_parked(conn, self.sink.name, [bucket], size, 1, worker=self.worker,
                                        fences={bucket: fence})
            read = fetch_events(conn, self.sink, self.worker, {bucket: (size, cursor)}, fences={bucket: fence})
        if bucket not in read.held:  # fenced out (the parked read above returned nothing of it then)
            self.losses.lose({bucket}, {bucket: fence})
            return 0
        new = read.events
        if not parked and not new:
            return self._probe_idle(bucket, fence, cursor.after_read(read.now, None, full=False))
        advance = {bucket: cursor.after_read(read.now, new[-1].position, full=len(new) >= size)} if new else {}
        self.book.number_read(parked, {bucket: fence})  # delivered first: the earlier read
        self.book.number_read(new, {bucket: fence})
        grown = next_probe_size(size, self.reads.bucket_limit(held))
        healthy = grown == HEALTHY
        ok = self.batches.run([*parked, *new], {bucket: fence}, advance, resets={bucket} if healthy else set())
        if bucket in ok:
            if healthy:
                self.ramp.healthy(bucket)
                log.info("sink %s: bucket %d is healthy again", self.sink.name, bucket)
            else:
                self.ramp.grow(bucket, grown)
        return len(parked) + len(new)

    def _probe_alone(self, bucket: int, fence: int) -> int:
        """Deliver the bucket's next event alone, its attempt counted first."""
        fences = {bucket: fence}
        write = self.writer.write
        for _ in range(PROBE_QUIET_STEPS):
            cursor = self.book.read_cursor(bucket)
            with self.pool.connection() as conn:
                events = store.fetch_parked(conn, self.sink.name, [bucket], 1, 1, worker=self.worker, fences=fences)
                read = None if events else fetch_events(conn, self.sink, self.worker, {bucket: (1, cursor)}, fences)
            if read is not None:
                events = read.events
                if not events:
                    return self._probe_idle(bucket, fence, cursor.after_read(read.now, None, full=False))
            self.book.number_read(events, fences)
            e = events[0]
            advance = {} if read is None else {bucket: cursor.after_read(read.now, e.position, full=True)}
            cp = Checkpoint(fences=fences, advance=advance)
            if e.blocked:  # its key waits for a parked head: queue behind it, deliver nothing
                cp.park.append((e, e.attempts, 0.0, None))
                if not write(cp):
                    return 0
                continue
            if e.attempts >= self.settings.max_attempts:  # crashed the relay on every attempt
                cp.dead.append((e, e.attempts, e.last_error or CRASH_ERROR))
                cp.done.append(e)
                if not write(cp):
                    return 0
                continue
            attempts = e.attempts + 1
            # The deaths that made the bucket a suspect happened with this event in the batch: charged to it from
            # the first, so --max-attempts N costs about N deaths, not max_lapses + N. An event charged a crash
            # already carries its deaths; an innocent one's charge is replaced by its own outcome's count
            # (``Batches.run`` parks it with ``e.attempts + 1``), so only a death keeps it.
            deaths = self.ramp.deaths(bucket) if e.last_error != CRASH_ERROR else 0
            cp.park.append((e, attempts + deaths, self.backoff.delay(attempts), CRASH_ERROR))
            if not write(cp):
                return 0
            e.parked = True  # it is now; ``attempts`` stays the count before this attempt
            try:
                landed = self.batches.run([e], fences, {}, resets=set(), alone=True)
            except Exception as exc:
                if not points_at_events(exc):
                    raise
                # The attempt was counted before it was made; record why it failed.
                error = describe_error(exc)
                log.warning("sink %s: event %s (key %r) failed alone, attempt %d: %s", self.sink.name, e.id, e.key,
                            attempts, error)
                write(Checkpoint(fences=fences, park=[(e, attempts, self.backoff.delay(attempts), error)]))
                return 1
            if bucket in landed:
                self.ramp.grow(bucket, 2)
            return 1
        return 0

    def _probe_idle(self, bucket: int, fence: int, caught_up: Cursor) -> int:
        """Nothing due in a suspect bucket: once nothing is parked there either, it is healthy.
        ``caught_up``: its cursor past the empty delta just read."""
        advance = {bucket: caught_up}
        with self.pool.connection() as conn:
            waiting = store.has_parked(conn, self.sink.name, bucket)
        if waiting:  # a parked retry is still to come
            self.writer.write(Checkpoint(fences={bucket: fence}, advance=advance))
            return 0
        ok = self.writer.write(Checkpoint(fences={bucket: fence}, advance=advance, resets={bucket}))
        if bucket in ok:
            self.ramp.healthy(bucket)
        return 0
