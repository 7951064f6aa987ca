"""A time limit for projection handlers: a batch's walk runs on a helper thread the runner can abandon.

Python can not kill a thread, and a handler that never returns (a socket without a timeout, a
deadlock in a library) would otherwise hold the runner thread, so every bucket of the sink, its
transaction, row locks and the vacuum horizon, and keep the process from stopping. So the walk (the
handlers and the relay's statements of one transaction) runs on a helper thread, one per sink,
reused from batch to batch; the runner thread waits for it, checking its stop flag, and gives up on
it when one handler call has run for longer than the limit (or the relay's own statements made no
progress for that long):

1. Unless the walk already began its checkpoint, it is marked abandoned under the walk's lock,
   and the helper checks that mark under the same lock right before the checkpoint: a walk the
   runner gave up on never commits, so the event can be charged and the batch redone without a
   double effect. (A walk caught inside its checkpoint is waited for once more, then ``SinkStuck``.)
2. Its transaction is ended from another connection (``end_walk``: ``pg_terminate_backend``), so
   its locks and the horizon go at once; the sink forgets that connection (the helper still holds
   it) and opens a new one for the next batch.
3. The helper thread is left to its handler; the next batch gets a new one. Abandoned threads still
   alive are counted per process; past ``MAX_ABANDONED`` (``over_cap``) the sink charges the event as
   usual, then raises ``SinkStuck`` and the relay exits (4) rather than pile up threads: the attempts
   were counted, and the restarted process starts without them.

The fast path pays two thread hand-offs per batch (not per event) and two attribute writes per
handler call.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from outbox_relay.errors import SinkStuck
from outbox_relay.sink import Aborted

log = logging.getLogger("outbox_relay.projections")

MAX_ABANDONED = 32  # threads left to handlers that never returned, per process, before it exits
WAIT_SLICE = 0.2  # how often the runner thread looks at its stop flag and the clock while it waits

_abandoned_lock = threading.Lock()
_abandoned: list[threading.Thread] = []  # guarded by _abandoned_lock


def abandoned_threads() -> int:
    """Helper threads left to handlers that have not returned yet (this process)."""
    with _abandoned_lock:
        _abandoned[:] = [t for t in _abandoned if t.is_alive()]
        return len(_abandoned)


class Abandoned(Exception):
    """Raised on an abandoned walk's helper thread at its checkpoint: nothing of it may land."""


class Walk:
    """One run of a batch on the helper thread. The helper writes ``event``/``since``/``pid`` and
    calls ``may_commit``; the runner thread reads them and may ``abandon``."""

    def __init__(self, fn: Callable[[Walk], Any]) -> None:
        self.fn = fn
        # The runner thread's context (the batch's tracing span is current there), so that the handler
        # calls on the helper thread are traced as children of it.
        self.context = contextvars.copy_context()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.event: Any = None  # the stored event whose handler runs now; None: the relay's own statements
        self.since = time.monotonic()  # when that call (or statement run) began
        self.pid: int | None = None  # backend of the walk's connection, once it has one
        self._lock = threading.Lock()
        self._abandoned = False
        self._committing = False

    def calling(self, event: Any) -> None:
        self.event, self.since = event, time.monotonic()

    def returned(self) -> None:
        self.event, self.since = None, time.monotonic()

    def may_commit(self) -> None:
        """Right before the checkpoint (helper thread): refuse if the runner gave up on this walk."""
        with self._lock:
            if self._abandoned:
                raise Abandoned()
            self._committing = True

    def abandon(self) -> bool:
        """Give up on the walk (runner thread); False if it is already in its checkpoint."""
        with self._lock:
            if self._committing:
                return False
            self._abandoned = True
            return True


class _Helper:
    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Walk | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"{name}-walk", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (walk := self._jobs.get()) is not None:
            try:
                walk.result = walk.context.run(walk.fn, walk)
            except BaseException as exc:  # handed to the runner thread, which raises it
                walk.error = exc
            walk.done.set()

    def submit(self, walk: Walk) -> None:
        self._jobs.put(walk)

    def close(self) -> None:
        self._jobs.put(None)


class TimedOut(Exception):
    """The walk was abandoned: ``event`` is the stored event whose handler did not return (None: the
    relay's own statements made no progress). Nothing of the walk landed."""

    def __init__(self, event: Any, seconds: float) -> None:
        super().__init__()
        self.event = event
        self.seconds = seconds


class Guard:
    """Runs walks on a helper thread with the time limit (one per sink, used by its runner thread)."""

    def __init__(self, name: str, timeout: float, end: Callable[[Walk], None]) -> None:
        self.name = name
        self.timeout = timeout
        self._end = end  # ends an abandoned walk's transaction and makes the sink forget its connection
        self._helper: _Helper | None = None
        self.over_cap = False  # more than MAX_ABANDONED threads are left to handlers: the sink stops the relay

    def run(self, fn: Callable[[Walk], Any], abort: threading.Event) -> Any:
        """``fn(walk)`` on the helper; its result, or what it raised. Raises ``TimedOut`` when the limit
        passed, ``Aborted`` on a hard stop (the walk abandoned in both cases)."""
        helper = self._helper = self._helper or _Helper(f"sink-{self.name}")
        walk = Walk(fn)
        helper.submit(walk)
        in_checkpoint = False
        while not walk.done.wait(WAIT_SLICE):
            stop = abort.is_set()  # each check also tells the runner this thread is alive
            overdue = time.monotonic() - walk.since > self.timeout
            if not stop and not overdue:
                continue
            if walk.abandon():
                self._give_up(walk, helper)
                if stop:
                    raise Aborted()
                raise TimedOut(walk.event, self.timeout)
            if overdue and in_checkpoint:  # its checkpoint hangs: whether it lands is unknown
                raise SinkStuck(f"sink {self.name}: a batch's checkpoint did not return within "
                                f"{2 * self.timeout:g}s; the relay stops so that its buckets move")
            if overdue:
                in_checkpoint = True
                walk.since = time.monotonic()  # one more limit for the checkpoint to come back
        if walk.error is not None:
            raise walk.error
        return walk.result

    def _give_up(self, walk: Walk, helper: _Helper) -> None:
        self._helper = None
        helper.close()  # if its handler ever returns, the thread ends
        with _abandoned_lock:
            _abandoned.append(helper.thread)
        try:
            self._end(walk)
        except Exception as exc:  # the walk can not commit anyway (may_commit); its locks wait for the server
            log.warning("sink %s: could not end the abandoned batch's transaction: %s", self.name, exc)
        if abandoned_threads() > MAX_ABANDONED:
            self.over_cap = True

    def check_cap(self) -> None:
        """Raise ``SinkStuck`` once more than MAX_ABANDONED threads are left to handlers (the sink calls it
        after the batch that charged the last one landed)."""
        left = abandoned_threads()
        if self.over_cap and left > MAX_ABANDONED:
            raise SinkStuck(f"sink {self.name}: {left} handlers that never returned are left on threads of this "
                            f"process (more than {MAX_ABANDONED}); the relay stops so that a fresh process "
                            "takes over (their events' attempts were counted)")
        self.over_cap = False

    def close(self) -> None:
        if self._helper is not None:
            self._helper.close()
            self._helper = None
