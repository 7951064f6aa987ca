"""What a relay did, in the log: one INFO line per interval, and a WARNING for attempts that keep failing.

A relay that delivers used to log nothing, and a handler that failed was retried 6-9 times in silence until
its dead letter. ``ActivityLog`` is an ``Observer`` (it counts what each sink's checkpoints landed) and a
worker ``Service`` (a thread that writes the counts every ``interval`` seconds, and nothing for an idle
interval). ``RetryLog`` rate-limits the runner's WARNING per failed attempt past the first few.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .observer import Observer

log = logging.getLogger("outbox_relay.activity")

WARN_FROM_ATTEMPT = 3  # the first failures of an event are routine (a deploy, a blip): counted, not warned of
RETRY_WARNING_SECONDS = 10.0  # per sink, at most one failed-attempt WARNING this often (the rest are counted)


@dataclass
class _Counts:
    delivered: int = 0
    retried: int = 0  # failed attempts: the event waits for its retry
    dead: int = 0
    held: int = 0  # parked for a condition of the sink (no attempt counted)

    def any(self) -> bool:
        return bool(self.delivered or self.retried or self.dead or self.held)

    def line(self, sink: str) -> str:
        parts = [f"delivered {self.delivered}"]
        if self.retried:
            parts.append(f"{self.retried} failed attempts (retrying)")
        if self.dead:
            parts.append(f"dead-lettered {self.dead}")
        if self.held:
            parts.append(f"held {self.held} for the sink")
        return f"{sink}: " + ", ".join(parts)


class ActivityLog(Observer):
    """Counts per sink, written as one INFO line every ``interval`` seconds by a thread of its own."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._counts: dict[str, _Counts] = {}  # sink -> since the last line; replaced whole by ``flush``
        self._since = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def batch(self, sink: str, *, size: int, delivered: int, retried: int, dead: int,
              latencies: Sequence[float]) -> None:
        with self._lock:
            c = self._counts.setdefault(sink, _Counts())
            c.delivered += delivered
            c.retried += retried
            c.dead += dead

    def held(self, sink: str, events: int) -> None:
        with self._lock:
            self._counts.setdefault(sink, _Counts()).held += events

    def flush(self) -> str | None:
        """The line for the counts since the last one (None: nothing happened), and start counting anew."""
        with self._lock:
            counts, self._counts = self._counts, {}
            since, self._since = self._since, time.monotonic()
        busy = {sink: c for sink, c in sorted(counts.items()) if c.any()}
        if not busy:
            return None
        return f"in the last {time.monotonic() - since:.0f}s: " + "; ".join(c.line(s) for s, c in busy.items())

    # -- the worker's Service

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="activity-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            line = self.flush()
            if line is not None:
                log.info("%s", line)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        line = self.flush()
        if line is not None:
            log.info("%s", line)


class RetryLog:
    """A sink runner's WARNINGs for failed attempts (runner thread only): from WARN_FROM_ATTEMPT on, at most one
    per RETRY_WARNING_SECONDS, saying how many more failed meanwhile."""

    def __init__(self, sink: str, seconds: float = RETRY_WARNING_SECONDS) -> None:
        self.sink = sink
        self.seconds = seconds
        self._last = -float("inf")
        self._suppressed = 0

    def failed(self, event_id: object, key: str, attempts: int, max_attempts: int, error: str | None) -> None:
        if attempts < WARN_FROM_ATTEMPT:
            return
        now = time.monotonic()
        if now - self._last < self.seconds:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more failed attempts of this sink since the last such line)" \
            if self._suppressed else ""
        self._last, self._suppressed = now, 0
        log.warning("sink %s: event %s (key %r) failed, attempt %d of %d: %s; it is retried%s", self.sink, event_id,
                    key, attempts, max_attempts, error, more)


__all__ = ["ActivityLog", "RetryLog"]
