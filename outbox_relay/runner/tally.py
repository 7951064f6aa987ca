"""What a landed checkpoint tells: dead letters and failed attempts in the log, counts and latencies to
the observer."""

from __future__ import annotations

import logging
import time

from ..activity import RetryLog
from ..errors import counted
from ..store import Checkpoint
from .hooks import Hooks
from .outcomes import CRASH_ERROR

log = logging.getLogger("outbox_relay.relay")  # every part of the runner logs as the relay


class Tally:
    def __init__(self, sink_name: str, max_attempts: int, hooks: Hooks) -> None:
        self.sink_name = sink_name
        self.max_attempts = max_attempts
        self.hooks = hooks
        self._retry_log = RetryLog(sink_name)  # a WARNING per failed attempt past the first few, rate-limited

    def landed(self, cp: Checkpoint, ok: set[int]) -> None:
        observer = self.hooks.observer
        dead = [(e, attempts, error) for e, attempts, error in cp.dead if e.bucket in ok]
        for e, attempts, error in dead:
            log.error("sink %s: event %s (key %r, type %s) dead-lettered after %s: %s",
                      self.sink_name, e.id, e.key, e.type, counted(attempts, "attempt"), error)
        delivered = [e for e in cp.delivered if e.bucket in ok]
        # A parked event with an error but no attempt added waits for a condition of the sink (held).
        retried = held = 0
        for e, attempts, _, why in cp.park:
            if why is not None and e.bucket in ok:
                if attempts > e.attempts:
                    retried += 1
                    if why != CRASH_ERROR:  # a probe's attempt counted before it is made: not a failure yet
                        self._retry_log.failed(e.id, e.key, attempts, self.max_attempts, why)
                else:
                    held += 1
        if held:
            observer.held(self.sink_name, held)
        if delivered or dead:
            observer.checkpointed(self.sink_name, delivered=[e.id for e in delivered],
                                  dead=[e.id for e, _, _ in dead])
        if delivered or retried or dead:
            at = cp.landed_at
            ages = [(at - e.stored_at).total_seconds() for e in delivered if at and e.stored_at]
            if ages:
                observer.ages(self.sink_name, ages)
            # From when it became visible to the relay: not before the last read that could not see it
            # (nor before its storing), so a business transaction kept open is not counted as ours.
            now = time.monotonic()
            latencies = [min(age, now - e.unseen_at) if e.unseen_at is not None else age
                         for e, age in zip((e for e in delivered if at and e.stored_at), ages, strict=True)]
            observer.batch(self.sink_name, size=len(delivered) + retried + len(dead), delivered=len(delivered),
                           retried=retried, dead=len(dead), latencies=latencies)
