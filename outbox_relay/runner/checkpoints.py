"""The checkpoint writer: every fenced write of a runner, the server-restart checks its cursors need, and
the delivered batch whose fence check waits for the next read (runner thread only)."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime

import psycopg
from psycopg_pool import ConnectionPool

from .. import store
from ..backoff import Backoff
from ..dsn import describe_error
from ..errors import CheckpointFailed, LeaseLost
from ..settings import RelaySettings
from ..sinks.engine import AsyncConn
from ..store import Checkpoint, Conn
from .cursors import CursorBook
from .gate import Pulse
from .hooks import Hooks
from .leases import Leases, Losses
from .parked import ParkSchedule
from .tally import Tally

log = logging.getLogger("outbox_relay.relay")  # every part of the runner logs as the relay

# Between attempts at a checkpoint whose connection broke (``CheckpointWriter.write_alone``).
CHECKPOINT_RETRY = Backoff(0.05, 1.0)


class CheckpointWriter:
    def __init__(self, sink_name: str, worker: str, pool: ConnectionPool[Conn], settings: RelaySettings, *,
                 book: CursorBook, leases: Leases, losses: Losses, tally: Tally, park: ParkSchedule, hooks: Hooks,
                 abort: Pulse, draining: threading.Event) -> None:
        self.sink_name = sink_name
        self.worker = worker
        self.pool = pool
        self.settings = settings
        self.book = book
        self.leases = leases
        self.losses = losses
        self.tally = tally
        self.park = park
        self.hooks = hooks
        self.abort = abort
        self.draining = draining
        self.server_started: datetime | None = None  # the server start the read cursors come from
        # A delivered Kafka batch's checkpoint whose fence check rides on the next read (``BatchCommit.later``):
        # settled by ``Delivery.deliver_new``'s read of its buckets, or by a statement of its own
        # (``settle_pending``) before anything else writes their cursors. Its cursors are in ``book.ahead``.
        self.pending: Checkpoint | None = None

    # -- fenced writes ---------------------------------------------------------------------

    def write(self, cp: Checkpoint) -> set[int]:
        """A checkpoint of the runner's own (isolation steps, cursors flushed), outside any sink transaction."""
        ok = self.checkpoint(cp, None)
        self.landed(cp, ok)
        return ok

    def checkpoint(self, cp: Checkpoint, tx: Conn | None) -> set[int]:
        """Write ``cp`` in the sink's transaction ``tx``, or on its own; returns the buckets whose fence held."""
        cp.lease_seconds = self.settings.lease_seconds
        if isinstance(tx, psycopg.Connection):
            self.require_same_start(store.server_started(tx))
        try:
            ok = (store.checkpoint(tx, self.sink_name, self.worker, cp) if tx is not None
                  else self.write_alone(cp))
        except psycopg.Error as exc:
            raise CheckpointFailed(f"sink {self.sink_name}: checkpoint failed: {describe_error(exc)}") from exc
        return self.fenced(cp, ok, in_tx=tx is not None)

    async def acheckpoint(self, cp: Checkpoint, tx: AsyncConn) -> set[int]:
        """``checkpoint`` in a sink's async transaction (the runner's thread waits for this one meanwhile)."""
        cp.lease_seconds = self.settings.lease_seconds
        self.require_same_start(await store.aserver_started(tx))
        try:
            written = await store.acheckpoint(tx, self.sink_name, self.worker, cp)
        except psycopg.Error as exc:
            raise CheckpointFailed(f"sink {self.sink_name}: checkpoint failed: {describe_error(exc)}") from exc
        return self.fenced(cp, written, in_tx=True)

    def write_alone(self, cp: Checkpoint) -> set[int]:
        """Write ``cp`` on a pooled connection. One that only moves cursors sets them to absolute positions,
        so writing it twice is harmless: if the connection breaks (a failover, a terminated backend), it is
        written again on a new one, for as long as the lease may hold, rather than given up, which would
        have the whole batch, already delivered, sent again."""
        attempt = 0
        deadline = time.monotonic() + self.settings.lease_seconds
        while True:
            try:
                with self.pool.connection() as conn:
                    self.require_same_start(store.server_started(conn))
                    return store.checkpoint(conn, self.sink_name, self.worker, cp)
            except psycopg.OperationalError as exc:
                attempt += 1
                delay = CHECKPOINT_RETRY.delay(attempt)
                stopping = self.draining.is_set() or self.abort.is_set()
                if not cp.moves_only or stopping or time.monotonic() + delay >= deadline:
                    raise
                log.info("sink %s: checkpoint failed (%s); writing it again in %.2fs", self.sink_name,
                         describe_error(exc), delay)
                self.abort.wait(delay)

    def fenced(self, cp: Checkpoint, ok: set[int], in_tx: bool) -> set[int]:
        lost = set(cp.fences) - ok
        if lost:
            self.losses.lose(lost, cp.fences)
            if in_tx:
                raise LeaseLost(f"sink {self.sink_name}: lost buckets {sorted(lost)}")
        return ok

    def landed(self, cp: Checkpoint, ok: set[int]) -> None:
        self.book.landed(cp, ok, time.monotonic())
        if cp.park:
            self.park.now()
        self.tally.landed(cp, ok)

    # -- server restarts -------------------------------------------------------------------

    def same_server(self, conn: Conn) -> bool:
        """Whether ``conn``'s server is the one the read cursors were read from. After a crash restart
        PostgreSQL hands out again the transaction ids whose WAL had not reached disk, so a snapshot
        taken before it can count a new transaction as seen and its events would be skipped. Cursors as
        written are safe (their write committed after their snapshot was taken, so recovery resumes
        past its xmax); the ones held only in memory (ahead, deferred writes) are dropped here, and
        their buckets are read again from the written ones (duplicates, never a gap)."""
        return self.same_start(store.server_started(conn))

    def same_start(self, started: datetime) -> bool:
        """``same_server`` for a server start time already read."""
        if started == self.server_started:
            return True
        known, self.server_started = self.server_started, started
        if known is None:
            return True
        if self.book.ahead:
            log.warning("sink %s: the database server restarted; %d buckets are read again from their stored "
                        "cursors", self.sink_name, len(self.book.ahead))
        self.book.drop_unwritten()
        self.pending = None  # its cursors were among them: not landed, its events are read again
        return False

    def require_same_start(self, started: datetime) -> None:
        """A checkpoint's cursors come from reads before it: refused if the server restarted since."""
        if not self.same_start(started):
            raise CheckpointFailed(f"sink {self.sink_name}: the database server restarted since this batch was "
                                   "read; it is read again from the stored cursors")

    # -- the waiting fence check -----------------------------------------------------------

    def fold(self, cp: Checkpoint) -> None:
        """Let ``cp`` (which ``CursorBook.foldable`` allowed) wait for the next read to check its fence."""
        self.settle_pending()  # never two waiting: the read of this batch took the previous one's
        cp.lease_seconds = self.settings.lease_seconds
        cp.defer = set(cp.advance)
        self.book.fold(cp)
        self.pending = cp

    def take_pending(self) -> Checkpoint | None:
        """The checkpoint waiting for its fence check, taken, without the buckets this runner no longer holds
        under its fences (lost meanwhile, and told so by whoever dropped them: that batch did not land)."""
        cp, self.pending = self.pending, None
        if cp is None:
            return None
        held = self.leases.snapshot()
        kept = {b: f for b, f in cp.fences.items() if held.get(b) == f}
        if kept != cp.fences:
            cp.fences = kept
            cp.advance = {b: c for b, c in cp.advance.items() if b in kept}
            cp.defer &= kept.keys()
            cp.delivered = [e for e in cp.delivered if e.bucket in kept]
        return cp if kept else None

    def put_back(self, cp: Checkpoint | None) -> None:
        """A read that was to check ``cp``'s fence did not happen: it waits for the next one."""
        if self.pending is None:
            self.pending = cp

    def settle_pending(self) -> None:
        """Check the waiting checkpoint's fence with a statement of its own (the read-only ``advance``):
        before anything else writes its buckets' cursors, and when the runner lets its buckets go."""
        cp = self.take_pending()
        if cp is not None:
            self.landed(cp, self.checkpoint(cp, None))

    # -- cursor flushes --------------------------------------------------------------------

    def until_flush(self, now: float) -> float:
        """Seconds until deferred cursor writes are due (inf: none): the longest an idle runner may wait.
        While nothing holds vacuum back, a batch whose fence check waits for the next read counts too:
        its cursors go out with the next write rather than wait for a read that may be seconds away."""
        held = self.hooks.defer_writes()
        until = self.book.until_owed_flush(held, now)
        if self.pending is not None and not held:
            until = min(until, self.book.until_busy_flush(now))
        return until

    def flush_due(self, held: dict[int, int], busy: bool) -> None:
        """At the end of a cycle: write the cursors that are due, if any."""
        now = time.monotonic()
        if self.book.ahead_due(now):
            self.flush_ahead(held)
        elif self.book.owed_due_now(busy, self.hooks.defer_writes(), now) or (
                not busy and self.pending is not None and self.until_flush(now) <= 0):
            self.flush_owed(held)

    def flush_ahead(self, held: dict[int, int]) -> None:
        """Write the read cursors that passed empty deltas: for a sink that skips most events (a
        projection), so that retention can delete what it passed; for all, so that a next owner does
        not read those deltas again. Deferred cursor writes go with them."""
        self.settle_pending()  # its cursors are among them: checked first, so that it lands as a batch
        held = self.leases.still_held(held)
        self.book.flushed_at = time.monotonic()
        ahead = self.book.ahead_in(held)
        if ahead:
            self.write(Checkpoint(fences={b: held[b] for b in ahead}, advance=ahead))

    def flush_owed(self, held: dict[int, int]) -> None:
        """Write the deferred cursors that are due (one statement for all of them). While nothing holds
        vacuum back, a batch whose fence check waits is written with them: the write is its check."""
        vacuum_held = self.hooks.defer_writes()
        pending = self.take_pending() if not vacuum_held else None
        if vacuum_held:
            self.settle_pending()
        held = self.leases.still_held(held)
        due = self.book.owed_due(held, vacuum_held, time.monotonic())
        if pending is not None:
            pending.defer = set()
            for b, cursor in due.items():
                if b not in pending.advance:  # the batch's own buckets: its cursors are the newest
                    pending.fences[b], pending.advance[b] = held[b], cursor
            self.write(pending)
        elif due:
            self.write(Checkpoint(fences={b: held[b] for b in due}, advance=due))
