"""The lanes of an async sink (``async def deliver``): tasks on the sink's event loop (loop.py).

A sync sink's lanes are threads (adapter.py). An async sink's calls all run on its one event loop, and a lane
thread handing each call to that loop and waiting for the answer cost two thread hops per event. Here a lane
is one task per batch on that loop, taking keys and awaiting the user's ``deliver`` for their events one at a
time, with the rules of a lane thread: one key at a time, in order; a key stops at its first failure that will
be retried; a ``SinkUnavailable`` stops the run; what a detached lane does is recorded nowhere. The runner
thread hands a batch's lanes to the loop in one hop (``start``) and is woken once, by the last lane to end.

The runner keeps the clock (adapter.py ``_wait``): a call past the time limit is cancelled and charged
(``TaskLane.abandon``); one that goes on after its cancel counts against the process's cap of calls that never
returned (timelimit.py ``leave``) until it ends. A loop that runs nothing else for longer than the time limit
(a call blocks it) is given up on as a whole (``SinkLoop.abandon``; adapter.py ``_check_loop``).

The lanes take the run's condition (a thread lock shared with the runner, which holds it only briefly) around
recording an outcome and taking the next event, never across an await.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from ..dsn import describe_error
from ..store import StoredEvent
from ..timelimit import leave
from .engine import Failure, Outcomes
from .loop import SinkLoop
from .user import SinkUnavailable


class Run(Protocol):
    """What a lane uses of the adapter's run of one batch (its attributes are guarded by ``cond``)."""

    keys: deque[list[StoredEvent]]
    outcomes: Outcomes
    cond: threading.Condition
    active: set[Any]
    unavailable: SinkUnavailable | None
    closed: bool
    context: contextvars.Context  # the runner's (the batch's span): each lane runs in a copy

    def call(self, e: StoredEvent) -> Any:
        """The user's call for ``e`` (an awaitable), or the Failure why the event can not be given."""

    def outcome(self, result: object) -> Failure | None:
        """What the engine makes of the call's answer."""

    def record(self, e: StoredEvent, result: Failure | SinkUnavailable | None, todo: deque[StoredEvent]) -> bool:
        """Take a call's result (under ``cond``); True when the lane stops (the sink is unavailable)."""


class TaskLane:
    """One lane of an async sink for one batch: a task on ``loop``. ``event``, ``since`` and ``detached`` are
    guarded by the run's condition."""

    def __init__(self, loop: SinkLoop) -> None:
        self.loop = loop
        self.event: StoredEvent | None = None  # whose call runs now
        self.since = time.monotonic()  # when that call began
        self.detached = False  # the runner moved on without it: it ends after its call, recording nothing
        self.task: asyncio.Task[None] | None = None  # set on the loop before the task's first step

    def detach(self) -> None:
        self.detached = True

    def abandon(self) -> bool:
        """Give up on the call in flight (past the time limit): cancel it, and count it against the process's
        cap for as long as it does not end. True when the process is now over the cap."""
        self.detached = True
        task, sink_loop = self.task, self.loop
        sink_loop.submit(self._cancel)  # a loop that takes no more work cancels its tasks itself
        # Counted while it runs, unless its loop was given up on: then the loop is counted, once.
        return leave(lambda: task is not None and not task.done() and not sink_loop.abandoned
                     and sink_loop.thread.is_alive())

    def _cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def begin(self, run: Run) -> None:
        """On the loop: the lane's task (none if the loop is stopping or the runner gave up on it already)."""
        if not self.loop.stopping and not self.detached:
            self.task = self.loop.loop.create_task(self._work(run), context=run.context.copy())

    async def _work(self, run: Run) -> None:
        # A twin of the thread lane's loop (adapter._Run.work), kept by hand: that one blocks in the call, this
        # one awaits it; the rules they share (what a result does to the key and the batch) are in ``record``.
        cond = run.cond
        todo: deque[StoredEvent] = deque()  # the rest of this lane's current key
        cond.acquire()
        try:
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
                if run.record(e, result, todo):
                    return
        finally:
            run.active.discard(self)
            if not run.active:
                cond.notify_all()  # the runner waits for the last lane only
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
            if self.detached or self.loop.stopping:
                self.detached = True  # the runner's cancel of an abandoned call, or the loop's end: recorded nowhere
                return None
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # the sink's code cancelled its own call: a failed attempt, the lane goes on
            return Failure(describe_error(exc))
        # SystemExit, KeyboardInterrupt too: out of the task they would end the sink's event loop.
        except BaseException as exc:
            return Failure(describe_error(exc))
        return run.outcome(result)


def start(loop: SinkLoop, run: Run, count: int) -> Sequence[TaskLane]:
    """``count`` lanes on ``run``, handed to ``loop`` in one hop (the caller holds ``run.cond``); they are in
    ``run.active`` at once. None if the loop takes no more work."""
    lanes = [TaskLane(loop) for _ in range(count)]

    def begin() -> None:
        for lane in lanes:
            lane.begin(run)

    if not lanes or not loop.submit(begin):
        return ()
    run.active.update(lanes)
    return lanes


__all__ = ["Run", "TaskLane", "start"]
