"""One time limit for the user's code the engine calls: a projection batch's walk (projections/guard.py), a
user sink's ``deliver`` (sinks/adapter.py) and an inbox handler (inbox/store.py).

Python can not kill a thread, and a handler that never returns (a socket without a timeout, a deadlock
in a library) would otherwise hold the thread that called it, with its transaction, locks and the
process's shutdown. So the call runs on a ``HandlerThread`` (reused from call to call) while its owner
waits with a deadline (``Deadline``), and past it the owner gives up on it:

1. ``Call.abandon`` and ``Call.begin_commit`` take the call's lock, so the owner decides whether the work
   may still commit: a call abandoned before its commit began never commits; one caught committing is
   the owner's to wait for.
2. The owner makes whatever the thread still does harmless (ends its transaction, closes its
   connection) and ``HandlerThread.abandon`` leaves the thread to its handler: it ends if that returns.
3. Abandoned threads still alive are counted in one registry for the whole process, whoever abandoned
   them, with an async sink's calls that went on after they were cancelled and event loops a call
   blocked (``leave``). Past ``MAX_ABANDONED`` the owner that crossed it charges its event as usual, then stops the
   process (the relay exits 4, the inbox consumer stops) rather than pile up threads; the restarted
   process starts without them, and the attempts were counted.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, Literal, TypeVar

MAX_ABANDONED = 32  # threads left to handlers that never returned, per process, before it stops
WAIT_SLICE = 0.2  # how often an owner looks at its stop flag and the clock while it waits

T = TypeVar("T")

_abandoned_lock = threading.Lock()
_abandoned: list[Callable[[], bool]] = []  # each: does it still run? (guarded by _abandoned_lock)


def abandoned_threads() -> int:
    """Threads (or async calls, or event loops) left to handlers that have not returned yet (this process,
    every owner)."""
    with _abandoned_lock:
        _abandoned[:] = [alive for alive in _abandoned if alive()]
        return len(_abandoned)


def leave(alive: Callable[[], bool]) -> bool:
    """Count a call given up on for as long as ``alive()`` says it still runs (an abandoned thread, an async
    call that did not end when it was cancelled, an event loop a call blocks); True when the process is now
    over the cap."""
    with _abandoned_lock:
        _abandoned.append(alive)
    return over_cap()


def over_cap() -> bool:
    """More than ``MAX_ABANDONED`` threads of this process are left to handlers that never returned."""
    return abandoned_threads() > MAX_ABANDONED


def cap_exceeded(what: str) -> str | None:
    """Why the process stops, if it is over the cap (``what``: the owner's word for its calls), else None."""
    left = abandoned_threads()
    if left <= MAX_ABANDONED:
        return None
    return (f"{left} {what} that never returned are left on threads of this process (more than {MAX_ABANDONED}, "
            "counted over every sink and inbox of the process); it stops so that a fresh process takes over "
            "(their attempts were counted)")


class HandlerThread:
    """A thread that runs work items one after the other until it is closed or abandoned."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.detached = False  # its owner moved on without it: it ends after its current work
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work`` next (it must not raise: a ``Call`` hands what it raised to its owner)."""
        self._jobs.put(work)

    def idle(self) -> None:
        """Called on the thread after each work item it is still owned for (a pool puts it back here)."""

    def close(self) -> None:
        """End after the work queued so far."""
        self._jobs.put(None)

    def detach(self) -> None:
        """The owner moves on without this thread (a hard stop): it ends after its current work."""
        self.detached = True
        self.close()

    def abandon(self) -> bool:
        """Leave the thread to a handler past its time limit and count it in the process's registry; True
        when the process is now over the cap (the owner stops it once the charge landed)."""
        self.detach()
        return leave(self.thread.is_alive)

    def _loop(self) -> None:
        while (work := self._jobs.get()) is not None:
            work()
            if self.detached:
                return
            self.idle()


class Call(Generic[T]):
    """One call handed to a ``HandlerThread``: its result or error, when its current step began (``since``,
    which the worker may move on), and the abandon protocol."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        # The owner's context (the batch's tracing span is current there), so that what runs on the
        # handler thread is traced as its child.
        self.context = contextvars.copy_context()
        self.done = threading.Event()
        self.since = time.monotonic()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._abandoned = False
        self._committing = False

    def __call__(self) -> None:
        """On the handler thread."""
        try:
            self._result = self.context.run(self.fn)
        except BaseException as exc:  # handed to the owner, which raises it
            self._error = exc
        self.done.set()

    def result(self) -> T:
        """What the call returned, or raise what it raised (once ``done``)."""
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def begin_commit(self) -> bool:
        """Right before the call's work commits (handler thread): False if the owner gave up on it."""
        with self._lock:
            if self._abandoned:
                return False
            self._committing = True
            return True

    def abandon(self) -> bool:
        """Give up on the call (owner); False if it already began to commit."""
        with self._lock:
            if self._committing:
                return False
            self._abandoned = True
            return True


class Deadline:
    """The owner's side: one reused ``HandlerThread`` and the wait for each call with the time limit."""

    def __init__(self, name: str, seconds: float) -> None:
        self.name = name  # the handler thread's
        self.seconds = seconds
        self._thread: HandlerThread | None = None

    def start(self, call: Call[T]) -> None:
        thread = self._thread = self._thread or HandlerThread(self.name)
        thread.submit(call)

    def wait(self, call: Call[T], stop: threading.Event | None = None) -> Literal["done", "overdue", "stop"]:
        """Until ``call`` is done, ``stop`` is set (looked at every ``WAIT_SLICE``; each look also tells a
        watchdog this thread is alive) or its current step has run longer than ``seconds``."""
        while True:
            left = call.since + self.seconds - time.monotonic()
            if call.done.wait(min(WAIT_SLICE, max(left, 0.0))):
                return "done"
            if stop is not None and stop.is_set():
                return "stop"
            if time.monotonic() - call.since > self.seconds:
                return "overdue"

    def give_up(self) -> bool:
        """Abandon the thread of the call just given up on (``Call.abandon``); the next call gets a new one.
        True when the process is now over the cap."""
        thread, self._thread = self._thread, None
        return thread.abandon() if thread is not None else over_cap()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None


__all__ = ["MAX_ABANDONED", "WAIT_SLICE", "Call", "Deadline", "HandlerThread", "abandoned_threads", "cap_exceeded",
           "leave", "over_cap"]
