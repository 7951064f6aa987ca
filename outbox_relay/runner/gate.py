"""What every runner of a process shares to deliver: the admission gate and a runner's stop flag."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator

from ..sinks.engine import Aborted


class DeliveryGate:
    """Admission to delivery, shared by every runner of a process. Batches share it; an
    isolation probe holds it alone, so that a crash during a probe can only be the probed
    event's doing, whichever sink's runner made it. Waiting probes hold new batches back.

    A holder that has been in for ``stale_seconds`` (a stuck sink) no longer counts: one stuck sink
    must not stop the others. A crash while a stale batch is still in would be charged to the probed
    event, an innocent one's attempt counted at worst."""

    def __init__(self, stale_seconds: float = float("inf")) -> None:
        self._cond = threading.Condition()
        self.stale_seconds = stale_seconds
        self._shared: dict[int, float] = {}  # holder -> when it came in
        self._exclusive: float | None = None  # when the probe came in
        self._waiting = 0
        self._ids = itertools.count()

    def _live(self, since: float | None) -> bool:
        return since is not None and time.monotonic() - since < self.stale_seconds

    @contextlib.contextmanager
    def shared(self, abort: threading.Event) -> Iterator[None]:
        me = next(self._ids)
        with self._cond:
            since = time.monotonic()
            while self._live(self._exclusive) or (self._waiting and time.monotonic() - since < self.stale_seconds):
                self._wait(abort)
            self._shared[me] = time.monotonic()
        try:
            yield
        finally:
            with self._cond:
                del self._shared[me]
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, abort: threading.Event) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._live(self._exclusive) or any(self._live(t) for t in self._shared.values()):
                    self._wait(abort)
            finally:
                self._waiting -= 1
                self._cond.notify_all()
            self._exclusive = since = time.monotonic()
        try:
            yield
        finally:
            with self._cond:
                if self._exclusive == since:
                    self._exclusive = None
                self._cond.notify_all()

    def _wait(self, abort: threading.Event) -> None:
        if abort.is_set():
            raise Aborted()
        self._cond.wait(0.1)


class Pulse(threading.Event):
    """A runner's hard-stop flag. Sinks check it while they work (``Sink.deliver``), so each check also
    says the runner's thread is alive: ``last`` is when it was last checked."""

    def __init__(self) -> None:
        super().__init__()
        self.last = time.monotonic()

    def is_set(self) -> bool:
        self.last = time.monotonic()
        return super().is_set()
