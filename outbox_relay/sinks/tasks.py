"""The lanes of an async sink (``async def deliver``): tasks on the sink's event loop.

A sync sink's lanes are threads (adapter.py); an async sink's calls all run on one event loop of the sink's
(so that a client it keeps serves them all), and a lane thread per key handing each call to that loop and
waiting for its answer cost two thread hops per event. Here a lane is a task on that loop that takes keys
and awaits the user's ``deliver`` for their events one at a time, with the same rules as a lane thread: one
key at a time, in order, a key stops at its first failure that will be retried, a ``SinkUnavailable``
stops the run, what a detached lane does is recorded nowhere. The runner thread keeps the clock
(adapter.py ``_wait``): a call past the time limit is cancelled and charged; one that does not end when
cancelled is counted against the process's cap of calls that never returned (timelimit.py ``leave``).

The lanes take the run's condition (a thread lock, shared with the runner) only around recording an
outcome and taking the next event, never across an await.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import deque
from typing import Any, Protocol

from ..dsn import describe_error
from ..store import StoredEvent
from ..timelimit import leave
from .engine import Failure, Outcomes
from .user import SinkUnavailable


class Run(Protocol):
    """What a lane uses of the adapter's run of one batch (its attributes are guarded by ``cond``)."""

    keys: deque[list[StoredEvent]]
    outcomes: Outcomes
    cond: threading.Condition
    active: set[Any]
    unavailable: SinkUnavailable | None
    closed: bool

    def call(self, e: StoredEvent) -> Any:
        """The user's call for ``e`` (an awaitable, usually), or a Failure if the event can not be given."""

    def outcome(self, result: object) -> Failure | None:
        """What the engine makes of the call's answer."""


class TaskLane:
    """One lane of an async sink: a task on ``loop`` (run by ``thread``) working on one run.
    ``event``/``since``/``started``/``detached`` are guarded by the run's condition."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        self.loop = loop
        self.loop_thread = thread
        self.event: StoredEvent | None = None  # whose call runs now
        self.since = time.monotonic()  # when that call began (before it: when the lane was handed to the loop)
        self.started = False  # the loop began the task (a loop that does not within the time limit is stuck)
        self.detached = False  # the runner moved on without it: it ends after its call, recording nothing
        self.task: asyncio.Task[None] | None = None

    def take(self, run: Run, context: Any) -> None:
        """Start the lane on ``run`` as a task in ``context`` (the batch's: its calls' spans are children)."""
        self.since = time.monotonic()

        def start() -> None:
            self.task = self.loop.create_task(self._work(run), context=context)

        self.loop.call_soon_threadsafe(start)

    def detach(self) -> None:
        self.detached = True

    def abandon(self) -> bool:
        """Give up on the call in flight (past the time limit): cancel it, and count it against the process's
        cap for as long as it does not end. True when the process is now over the cap."""
        self.detached = True
        task, thread = self.task, self.loop_thread
        try:
            self.loop.call_soon_threadsafe(self._cancel)
        except RuntimeError:  # the loop is closed: nothing runs there any more
            return False
        return leave(lambda: task is not None and not task.done() and thread.is_alive())

    def _cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _work(self, run: Run) -> None:
        cond = run.cond
        todo: deque[StoredEvent] = deque()  # the rest of this lane's current key
        cond.acquire()
        try:
            self.started = True
            while not (run.closed or self.detached or run.unavailable is not None):
                if not todo:
                    if not run.keys:
                        return
                    todo.extend(run.keys.popleft())
                e = todo.popleft()
                self.event, self.since = e, time.monotonic()
                cond.release()
                try:
                    result = await self._call(run, e)
                finally:
                    cond.acquire()
                self.event = None
                if self.detached:
                    return  # abandoned: the runner already charged this call
                if isinstance(result, SinkUnavailable):
                    run.unavailable = result
                    return
                run.outcomes[e.id] = result
                if result is not None and result.retriable:
                    todo.clear()  # the key waits for this event's retry: its later events are not attempted
        finally:
            run.active.discard(self)
            cond.notify_all()
            cond.release()

    async def _call(self, run: Run, e: StoredEvent) -> Failure | SinkUnavailable | None:
        try:
            result = run.call(e)
            if isinstance(result, Failure):
                return result
            if inspect.isawaitable(result):
                result = await result
        except SinkUnavailable as exc:
            return exc
        except asyncio.CancelledError as exc:
            if self.detached:
                return None  # our own cancel of an abandoned call: recorded nowhere
            return Failure(describe_error(exc))  # the sink's code cancelled its own call
        # SystemExit, KeyboardInterrupt too: out of the task they would end the sink's event loop.
        except BaseException as exc:
            return Failure(describe_error(exc))
        return run.outcome(result)


def loop_lost(lanes: list[TaskLane], now: float, timeout: float) -> str | None:
    """Why the event loop of ``lanes`` (one run's, all on one loop) is lost, or None: the sink's code stopped
    it, or a lane handed to it more than ``timeout`` ago has not begun (a call blocks the loop)."""
    if any(not lane.loop_thread.is_alive() for lane in lanes):
        return "was stopped by the sink's code"
    if any(not lane.started and now - lane.since > timeout for lane in lanes):
        return f"ran nothing else for {timeout:g}s"
    return None


__all__ = ["Run", "TaskLane", "loop_lost"]
