"""One batch handed to the sink: admission, delivery, and the ``sink.Commit`` the sink writes it with."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

from ..backoff import Backoff
from ..dsn import describe_error
from ..errors import LeaseLost
from ..positions import Cursor
from ..sinks.engine import AsyncConn, Outcomes, Sink
from ..store import Checkpoint, Conn, StoredEvent
from .checkpoints import CheckpointWriter
from .cursors import CursorBook
from .gate import DeliveryGate, Pulse
from .hooks import Hooks
from .outcomes import classify, points_at_events
from .ramp import Ramp

log = logging.getLogger("outbox_relay.relay")  # every part of the runner logs as the relay


class Batches:
    """Delivers batches of one sink and checkpoints them (runner thread)."""

    def __init__(self, sink: Sink, gate: DeliveryGate, abort: Pulse, hooks: Hooks, *, writer: CheckpointWriter,
                 book: CursorBook, ramp: Ramp, max_attempts: int, backoff: Backoff) -> None:
        self.sink = sink
        self.gate = gate
        self.abort = abort
        self.hooks = hooks
        self.writer = writer
        self.book = book
        self.ramp = ramp
        self.max_attempts = max_attempts
        self.backoff = backoff

    def run(self, events: Sequence[StoredEvent], fences: dict[int, int], advance: dict[int, Cursor],
            resets: set[int], alone: bool = False) -> set[int]:
        """Deliver a batch (``alone``: nothing else in flight in this process) and checkpoint it.

        Returns the buckets whose checkpoint landed."""
        commit = BatchCommit(self, events, fences, advance, resets)
        to_send = [e for e in events if not e.blocked]
        try:
            with (self.gate.exclusive if alone else self.gate.shared)(self.abort), \
                    self.hooks.observer.delivering(self.sink, to_send) as observed:  # tracing hook: a span per batch
                ok = self.sink.deliver(to_send, fences, commit, self.abort)
                observed.landed(commit.checkpoint, ok)
        except LeaseLost:
            return set()  # the sink's transaction rolled back: nothing of this batch landed
        except Exception as exc:
            if not alone and points_at_events(exc):
                # Nothing says which event it was: deliver these buckets one event at a time, each
                # attempt counted first, so that the next failure is charged to its event.
                self.ramp.isolate(fences)
                log.warning("sink %s: a batch failed as a whole (%s); delivering buckets %s one event at a time "
                            "to find the event that causes it", self.sink.name, describe_error(exc), sorted(fences))
            raise
        if commit.checkpoint is not None and not commit.waits:  # a waiting one lands with the next read
            self.writer.landed(commit.checkpoint, ok)
        return ok


class BatchCommit:
    """The ``sink.Commit`` a runner hands its sink for one batch."""

    def __init__(self, batches: Batches, events: Sequence[StoredEvent], fences: dict[int, int],
                 advance: dict[int, Cursor], resets: set[int]) -> None:
        self.batches = batches
        self.writer = batches.writer
        self.events = events
        self.fences = fences
        self.advance = advance
        self.resets = resets
        self.checkpoint: Checkpoint | None = None  # what was written, once it was
        self.waits = False  # its fence check waits for the runner's next read (``later``)
        # Where each bucket read past its cursor started (the runner's cursors change only when a
        # checkpoint lands), and the events ``partial`` already wrote.
        self.start = {b: batches.book.read_cursor(b) for b in advance}
        self.settled: set[uuid.UUID] = set()

    def _plan(self, outcomes: Outcomes) -> Checkpoint:
        b = self.batches
        cp = classify(self.events, outcomes, self.fences, max_attempts=b.max_attempts, backoff=b.backoff)
        cp.advance = self.advance
        cp.resets = self.resets
        if self.settled:  # counted when ``partial`` wrote them
            cp.delivered = [e for e in cp.delivered if e.id not in self.settled]
        return cp

    def partial(self, outcomes: Outcomes) -> set[int]:
        """Checkpoint what of the batch is settled before all of it is (a sink without a transaction of
        its own may call this any number of times before ``__call__``): per bucket read past its cursor,
        the run of delivered events from the start of its part of the batch. The cursor then stands
        after the last of them, inside the read's delta, as between two pages of a large delta. A relay
        that loses the bucket before the batch's checkpoint hands over only the rest (fewer duplicates).
        The run stops at the first event not delivered yet, failed (the final checkpoint parks it and
        holds its key), or queued behind a parked one of its key. Returns the buckets written."""
        last: dict[int, StoredEvent] = {}
        stopped: set[int] = set()
        new: list[StoredEvent] = []
        for e in self.events:
            b = e.bucket
            if b in stopped or b not in self.start:
                continue
            if e.id not in self.settled:
                if e.parked or e.blocked or e.id not in outcomes or outcomes[e.id] is not None:
                    stopped.add(b)
                    continue
                new.append(e)
            last[b] = e
        buckets = {e.bucket for e in new}
        if not buckets:
            return set()
        advance = {}
        for b in buckets:
            end = self.advance[b]
            advance[b] = Cursor(self.start[b].seen, end.target if end.target is not None else end.seen,
                                last[b].position)
        cp = Checkpoint(fences={b: self.fences[b] for b in buckets}, advance=advance, delivered=new)
        ok = self.writer.write(cp)
        self.settled.update(e.id for e in new if e.bucket in ok)
        return ok

    def later(self, outcomes: Outcomes) -> set[int]:
        """``self(outcomes, None)`` for a sink that has delivered already and acts on nothing the answer says
        (the Kafka sink): a batch that only moves cursors, none of which must be written now, has its fence
        checked by the runner's next read, which starts the next cycle, instead of a statement of its own
        here. Returns the buckets it was read under; that read finds which held (``CheckpointWriter.pending``):
        the others are let go, and this batch is discarded there (redelivered by the next owner, in order),
        as a failed check is now. ``Observer.checkpointed`` comes with that read."""
        b = self.batches
        cp = self._plan(outcomes)
        if not b.book.foldable(cp, b.ramp.suspect, b.hooks.defer_writes(), time.monotonic()):
            return self(outcomes, None)
        self.writer.fold(cp)
        self.checkpoint = cp
        self.waits = True
        return set(cp.fences)

    def __call__(self, outcomes: Outcomes, tx: Conn | None) -> set[int]:
        b = self.batches
        cp = self._plan(outcomes)
        if tx is None:  # delivered already: its cursor write may wait (never in a sink's own transaction)
            cp.defer = b.book.deferrable(cp, b.ramp.suspect, b.hooks.defer_writes(), time.monotonic())
        ok = self.writer.checkpoint(cp, tx)
        self.checkpoint = cp
        return ok

    async def in_async(self, outcomes: Outcomes, tx: AsyncConn) -> set[int]:
        cp = self._plan(outcomes)
        ok = await self.writer.acheckpoint(cp, tx)
        self.checkpoint = cp
        return ok
