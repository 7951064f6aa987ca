"""The event loop of an async sink (``async def deliver``): one per sink, on a thread of its own.

Every call of the sink runs on it, so that a client the sink keeps (an HTTP session, a NATS connection) serves
them all. The loop is closed on every path, with what still ran there cancelled first, so that no coroutine
is left unawaited and no loop unclosed (asyncio warns of both, and the test suite makes warnings errors):

- ``stop``: the adapter closes (or gives up on) the loop. Work handed over but not begun is dropped (it
  was made to be: ``submit`` takes functions, never coroutines), the tasks left are cancelled and run until
  they end, then the loop is closed on its own thread. A task that ignores its cancel keeps the loop (and
  its thread) until it ends: closed under it, it would be destroyed pending.
- the sink's own code stops the loop (``loop.stop()``) or a callback raises ``SystemExit`` out of it: the
  loop runs on at once (its tasks, the sink's client's among them, are still there).
- a call blocks the loop (a blocking call in async code): ``blocked_for`` tells the adapter how long the
  loop has run nothing else (a beat every ``BEAT_SECONDS``); past the time limit the adapter gives up on it
  (``abandon``: stopped, counted against the process's cap while its thread lives) and starts a new one.
- interpreter exit: every loop still running is stopped as above (``atexit``), waiting at most
  ``EXIT_WAIT_SECONDS`` in all.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import contextvars
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..timelimit import WAIT_SLICE, leave

log = logging.getLogger("outbox_relay.sinks")

BEAT_SECONDS = WAIT_SLICE  # how often a loop notes that it runs (``blocked_for``)
CANCEL_SECONDS = 1.0  # a task left at the loop's end is cancelled again this often until it ends
EXIT_WAIT_SECONDS = 2.0  # at interpreter exit, for every loop to end

_running: weakref.WeakSet[SinkLoop] = weakref.WeakSet()  # loops not stopped yet (atexit stops them)


class SinkLoop:
    """An event loop on its own thread, named ``sink-NAME-loop``, until ``stop``."""

    def __init__(self, name: str) -> None:
        self.name = name  # the sink's, for log lines
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._stopping = False  # guarded by _lock: submit takes nothing more
        self.abandoned = False  # given up on (a call blocks it): what runs there is counted as the loop
        self._beat = time.monotonic()  # the loop's thread only (read anywhere)
        self.thread = threading.Thread(target=self._main, name=f"sink-{name}-loop", daemon=True)
        _running.add(self)
        self.thread.start()

    # -- any thread -------------------------------------------------------------------------------

    def submit(self, work: Callable[[], object]) -> bool:
        """Run ``work`` on the loop (soon, in order); False if the loop takes no more work (stopping)."""
        with self._lock:
            if self._stopping:
                return False
            self.loop.call_soon_threadsafe(work)
            return True

    def call(self, awaitable: Any, context: contextvars.Context) -> concurrent.futures.Future[Any]:
        """``awaitable`` as a task on the loop run in ``context`` (a lane thread's: the batch's span is current
        there, so the call's span is its child), for a sync ``deliver`` that returned one; cancelling the
        returned future cancels the task. A loop that is stopping begins nothing: the future is cancelled,
        the awaitable closed (never awaited, it would warn)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def drop() -> None:
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            future.cancel()

        def settle(task: asyncio.Task[Any]) -> None:
            if future.cancelled():
                return
            if task.cancelled():
                future.cancel()
            elif task.exception() is not None:
                future.set_exception(task.exception())
            else:
                future.set_result(task.result())

        def start() -> None:
            if future.cancelled() or self._stopping:
                drop()
                return
            task = self.loop.create_task(_awaited(awaitable), context=context)
            task.add_done_callback(settle)
            future.add_done_callback(lambda f: self.submit(task.cancel) if f.cancelled() else None)

        if not self.submit(start):
            drop()
        return future

    @property
    def running(self) -> bool:
        """The loop takes work and its thread runs."""
        return not self._stopping and self.thread.is_alive()

    def blocked_for(self) -> float:
        """How long the loop has run nothing else (0 while it keeps up with its beat)."""
        return max(0.0, time.monotonic() - self._beat - BEAT_SECONDS)

    def stop(self, wait: float = 0.0) -> bool:
        """Take no more work, cancel what runs and close the loop (on its thread); wait at most ``wait``
        seconds for that. True when the loop is closed."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                with contextlib.suppress(RuntimeError):  # closed already
                    self.loop.call_soon_threadsafe(self.loop.stop)
        _running.discard(self)
        if wait > 0 and self.thread is not threading.current_thread():
            self.thread.join(wait)
        return self.loop.is_closed()

    def abandon(self) -> bool:
        """Give up on a loop a call blocks: stopped (it ends when the call returns), and counted against the
        process's cap while its thread lives. True when the process is now over the cap."""
        self.abandoned = True
        self.stop()
        return leave(self.thread.is_alive)

    # -- the loop's thread ------------------------------------------------------------------------

    def _main(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        loop.call_soon(self._tick)
        while True:
            try:
                loop.run_forever()
            except BaseException as exc:  # SystemExit from a callback of the sink's: the loop goes on
                log.warning("sink %s: %s raised out of its event loop; the loop runs on", self.name,
                            type(exc).__name__)
            with self._lock:
                if self._stopping:
                    break
            log.warning("sink %s: its event loop was stopped by the sink's code; it runs on", self.name)
        try:
            self._wind_down()
        finally:
            loop.close()
            asyncio.set_event_loop(None)

    def _tick(self) -> None:
        self._beat = time.monotonic()
        if not self._stopping:
            self.loop.call_later(BEAT_SECONDS, self._tick)

    def _wind_down(self) -> None:
        """Run what was handed over (it sees the loop stopping), cancel every task until none is left."""
        loop = self.loop
        while True:
            with contextlib.suppress(RuntimeError):  # the sink's code stopped the loop again: once more
                loop.run_until_complete(asyncio.sleep(0))  # callbacks already queued run (and see _stopping)
            tasks = asyncio.all_tasks(loop)
            if not tasks:
                break
            for task in tasks:
                task.cancel()
            with contextlib.suppress(RuntimeError):
                loop.run_until_complete(asyncio.wait(tasks, timeout=CANCEL_SECONDS))
        with contextlib.suppress(RuntimeError):
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), CANCEL_SECONDS))

    @property
    def stopping(self) -> bool:
        """``stop`` was called: work handed over and not begun must not begin (loop thread)."""
        return self._stopping


class Raised(Exception):
    """A ``KeyboardInterrupt`` or ``SystemExit`` an async sink raised, carried to its lane: raised as is
    inside a task, asyncio re-raises them out of ``run_forever``."""

    def __init__(self, raised: BaseException) -> None:
        super().__init__()
        self.raised = raised


async def _awaited(awaitable: Any) -> Any:
    try:
        return await awaitable
    except (KeyboardInterrupt, SystemExit) as exc:
        raise Raised(exc) from None


@atexit.register
def _stop_every_loop() -> None:
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    for sink_loop in list(_running):
        sink_loop.stop(max(0.0, deadline - time.monotonic()))


__all__ = ["Raised", "SinkLoop"]
