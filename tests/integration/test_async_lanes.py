"""Issue 28: an async sink's lanes are tasks on its event loop (outbox_relay/sinks/tasks.py, loop.py), with every
guarantee a lane thread keeps: per-key order with ``concurrency`` keys at once, SinkUnavailable, partial
checkpoints, a hard stop, the time limit (a call past it is cancelled; one that goes on, or blocks the loop,
counts against the process's cap), a loop the sink's code stops, the batch's tracing context.

Every test ends with the loops it made closed and nothing left behind: no unclosed loop, no coroutine never
awaited, no task destroyed pending (``_nothing_left``, which collects garbage and fails on any of them).
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import logging
import random
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import warnings
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import timelimit
from outbox_relay.errors import SinkStuck
from outbox_relay.sinks import Outcome, Retry, SinkEvent, SinkUnavailable
from outbox_relay.sinks.adapter import EventSinkAdapter
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    dead_letters,
    fetch_all,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    release_fixture,
    run_until,
    runner_for,
    running,
    undelivered,
    user_sink_runner,
)
from tests.servers import wait_until

NAME = "async-lanes"
LOOP_THREAD = f"sink-{NAME}-loop"


def leftovers(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What asyncio says was left behind, once the garbage is collected: unclosed loops (ResourceWarning),
    coroutines never awaited (RuntimeWarning), tasks destroyed pending (logged by asyncio)."""
    found: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: found.append(f"unraisable: {u.exc_value!r}")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gc.collect()
            gc.collect()
    finally:
        sys.unraisablehook = hook
    found += [f"{w.category.__name__}: {w.message}" for w in caught
              if issubclass(w.category, ResourceWarning | RuntimeWarning)]
    found += [f"asyncio: {r.getMessage()}" for r in caplog.records
              if r.name == "asyncio" and r.levelno >= logging.ERROR]
    return found


def settled_abandoned() -> int:
    """The process's count of calls left running (timelimit), once calls an earlier test released have ended:
    unchanged for 0.3 s (at most 5 s)."""
    deadline = time.monotonic() + 5.0
    last, since = timelimit.abandoned_threads(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < 0.3:
        time.sleep(0.02)
        if (now := timelimit.abandoned_threads()) != last:
            last, since = now, time.monotonic()
    return last


@pytest.fixture(autouse=True)
def _nothing_left(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    settled_abandoned()
    yield
    # The loops this test made end once what ran there ended (the release fixture, torn down first, lets
    # calls that never returned return).
    wait_until(lambda: LOOP_THREAD not in {t.name for t in threading.enumerate()}, timeout=15,
               message="the sink's event loops ended")
    assert leftovers(caplog) == []


class AsyncSink:
    """An async user sink whose answer per call is ``await script(event)``; records every call."""

    name = NAME
    kind = "audit"

    def __init__(self, script: Callable[[SinkEvent], Awaitable[Outcome]] | None = None, *,
                 concurrency: int = 1) -> None:
        self.concurrency = concurrency
        self.script = script
        self.calls: list[SinkEvent] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.ok: set[uuid.UUID] = set()
        self.threads: set[str] = set()  # the threads the calls ran on
        self.loops: list[asyncio.AbstractEventLoop] = []  # the loops they ran on, first use first

    async def deliver(self, event: SinkEvent) -> Outcome:
        self.calls.append(event)
        self.threads.add(threading.current_thread().name)
        loop = asyncio.get_running_loop()
        if loop not in self.loops:
            self.loops.append(loop)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            result = await self.script(event) if self.script is not None else None
            if result is None:
                self.ok.add(event.id)
            return result
        finally:
            self.in_flight -= 1


def lane_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(f"sink-{NAME}-") and t.name != LOOP_THREAD]


def test_keys_at_once_each_in_order_on_the_loop_with_no_lane_threads(dsn: str) -> None:
    keys = [f"k{i % 8}" for i in range(160)]
    ids = publish(dsn, [(k, "t", {"n": n}) for n, k in enumerate(keys)])
    rnd = random.Random(7)

    async def script(e: SinkEvent) -> Outcome:
        await asyncio.sleep(0.002)
        return Retry("flaky") if rnd.random() < 0.1 and e.attempt == 1 else None

    sink = AsyncSink(script, concurrency=4)
    worker = Worker(make_settings(dsn, "w"), sinks=[EventSinkAdapter(sink)])
    with running(worker):
        wait_until(lambda: sink.ok == set(ids), timeout=30, message="every event delivered")
        assert lane_threads() == [], "an async sink's lanes are tasks, not threads"
    assert sink.most_in_flight > 1, "keys were delivered at once"
    assert sink.threads == {LOOP_THREAD}, "every call ran on the sink's one event loop"
    assert len(sink.loops) == 1 and sink.loops[0].is_closed(), "one loop, closed when the relay stopped"
    seen: dict[str, list[uuid.UUID]] = defaultdict(list)
    for c in sink.calls:  # per key, calls never go backwards: a retry repeats the head, never skips it
        ks = seen[c.key]
        if not ks or ks[-1] != c.id:
            ks.append(c.id)
    expected: dict[str, list[uuid.UUID]] = defaultdict(list)
    for i, k in zip(ids, keys, strict=True):
        expected[k].append(i)
    assert seen == expected


def test_one_key_is_never_two_calls_at_once(dsn: str, pool: ConnectionPool[Any]) -> None:
    ids = publish(dsn, [(f"k{n % 3}", "t", {"n": n}) for n in range(60)])
    busy: set[str] = set()
    overlaps: list[str] = []

    async def script(e: SinkEvent) -> Outcome:
        if e.key in busy:
            overlaps.append(e.key)
        busy.add(e.key)
        try:
            await asyncio.sleep(0.001)
        finally:
            busy.discard(e.key)
        return None

    sink = AsyncSink(script, concurrency=8)
    r, adapter = user_sink_runner(sink, pool, dsn)
    try:
        run_until(r, lambda: sink.ok == set(ids), timeout=30)
    finally:
        adapter.close()
    assert overlaps == [] and sink.most_in_flight > 1


def test_sink_unavailable_stops_the_batch_without_counting_attempts(dsn: str, pool: ConnectionPool[Any]) -> None:
    ids = publish(dsn, [("a", "t", {}), ("b", "t", {}), ("c", "t", {})])
    down = threading.Event()
    down.set()

    async def script(e: SinkEvent) -> Outcome:
        await asyncio.sleep(0)
        if down.is_set():
            raise SinkUnavailable("the endpoint is down", retry_after_seconds=0.3)
        return None

    sink = AsyncSink(script)
    r, adapter = user_sink_runner(sink, pool, dsn, max_attempts=2)
    try:
        run_until(r, lambda: len(parked_ids(dsn, NAME)) == 3)
        assert len(sink.calls) == 1, "one call said the sink is down: the rest of the batch was not attempted"
        rows = fetch_all(dsn, "SELECT attempts FROM outbox.parked WHERE sink = %s", (NAME,))
        assert rows == [(0,)] * 3, "no attempt counted"
        down.clear()
        run_until(r, lambda: not parked_ids(dsn, NAME), timeout=10)
    finally:
        adapter.close()
    assert sink.ok == set(ids) and not dead_letters(dsn, NAME)


def test_a_long_batch_checkpoints_what_is_delivered_while_a_slow_call_runs(
        dsn: str, pool: ConnectionPool[Any], release: threading.Event) -> None:
    ids = publish(dsn, [("slow", "t", {})] + [(f"k{i}", "t", {}) for i in range(20)])

    async def script(e: SinkEvent) -> Outcome:
        if e.id == ids[0]:
            while not release.is_set():  # slow, not stuck
                await asyncio.sleep(0.02)
        return None

    sink = AsyncSink(script, concurrency=2)
    r, adapter = user_sink_runner(sink, pool, dsn)
    adapter.partial_seconds = 0.2
    done = threading.Thread(target=run_until, args=(r, lambda: sink.ok == set(ids)), kwargs={"timeout": 40})
    done.start()
    try:
        wait_until(lambda: undelivered(dsn, NAME) == 1, timeout=20,
                   message="the other keys' events checkpointed while the slow call runs")
        assert ids[0] not in sink.ok
    finally:
        release.set()
        done.join(40)
        adapter.close()
    assert undelivered(dsn, NAME) == 0


def test_a_hard_stop_leaves_the_call_in_flight_and_checkpoints_nothing_of_its_batch(
        dsn: str, release: threading.Event) -> None:
    ids = publish(dsn, [("k", "t", {"n": n}) for n in range(3)])
    entered = threading.Event()

    async def script(e: SinkEvent) -> Outcome:
        entered.set()
        while not release.is_set():
            await asyncio.sleep(0.02)
        return None

    sink = AsyncSink(script)
    worker = Worker(make_settings(dsn, "w"), sinks=[EventSinkAdapter(sink)])
    assert worker.start()
    waiter = threading.Thread(target=worker.wait)
    waiter.start()
    try:
        assert entered.wait(20)
        started = time.monotonic()
        worker.stop_hard()
        waiter.join(15)
        assert not waiter.is_alive() and time.monotonic() - started < 5, "the runner did not wait for the call"
    finally:
        release.set()
        waiter.join(10)
    assert undelivered(dsn, NAME) == 3 and not parked_ids(dsn, NAME), "nothing of the batch was checkpointed"
    assert [c.id for c in sink.calls] == [ids[0]]


def test_a_hung_call_is_cancelled_at_the_time_limit_charged_and_not_counted(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    ids = publish(dsn, [("stuck", "t", {}), ("stuck", "t", {}), ("other", "t", {})])
    cancelled = threading.Event()

    async def script(e: SinkEvent) -> Outcome:
        if e.id == ids[0] and e.attempt == 1:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return None

    before = settled_abandoned()
    sink = AsyncSink(script)
    r, adapter = user_sink_runner(sink, pool, dsn, handler_timeout_seconds=0.3)
    try:
        run_until(r, lambda: ids[0] in parked_ids(dsn, NAME) or ids[0] in sink.ok, timeout=20)
        rows = fetch_all(dsn, "SELECT attempts, last_error FROM outbox.parked WHERE event_id = %s", (ids[0],))
        if rows:  # not retried yet
            assert rows[0][0] == 1 and "did not return within 0.3s" in rows[0][1]
        run_until(r, lambda: sink.ok == set(ids), timeout=20)
        assert cancelled.is_set() and timelimit.abandoned_threads() == before, "cancelled, so not left running"
    finally:
        adapter.close()
    assert [c.id for c in sink.calls if c.key == "stuck"] == [ids[0], ids[0], ids[1]], \
        "retried, then the key's next event"


def test_a_call_that_ignores_its_cancel_counts_against_the_cap_and_stops_the_relay_past_it(
        dsn: str, pool: ConnectionPool[Any], release: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = publish(dsn, [("stuck", "t", {}), ("b", "t", {})])
    cancels = 0

    async def script(e: SinkEvent) -> Outcome:
        nonlocal cancels
        while e.id == ids[0] and not release.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                cancels += 1  # ... and goes on
        return None

    before = settled_abandoned()
    monkeypatch.setattr(timelimit, "MAX_ABANDONED", before)  # one more left call is over the cap
    sink = AsyncSink(script, concurrency=2)
    r, adapter = user_sink_runner(sink, pool, dsn, handler_timeout_seconds=0.5)
    try:
        with pytest.raises(SinkStuck, match="calls of deliver that never returned"):
            run_until(r, lambda: False, timeout=20)
        wait_until(lambda: cancels == 1, timeout=5, message="the call was cancelled")
        assert timelimit.abandoned_threads() == before + 1
        rows = fetch_all(dsn, "SELECT attempts, last_error FROM outbox.parked WHERE event_id = %s", (ids[0],))
        assert rows[0][0] == 1 and "did not return within 0.5s" in rows[0][1], "charged before it stopped"
        assert ids[1] in sink.ok
        release.set()  # the call ends: it no longer counts
        wait_until(lambda: timelimit.abandoned_threads() == before, timeout=5, message="no longer counted")
    finally:
        adapter.close()


def test_a_call_that_blocks_the_loop_is_charged_and_the_other_keys_go_on_on_a_new_loop(
        dsn: str, pool: ConnectionPool[Any], release: threading.Event) -> None:
    ids = publish(dsn, [("stuck", "t", {}), ("stuck", "t", {}), ("b", "t", {}), ("c", "t", {})])

    async def script(e: SinkEvent) -> Outcome:
        if e.id == ids[0] and e.attempt == 1:
            release.wait()  # a blocking call inside async code: the whole loop waits
        return None

    before = settled_abandoned()
    sink = AsyncSink(script)
    r, adapter = user_sink_runner(sink, pool, dsn, handler_timeout_seconds=0.5)
    try:
        run_until(r, lambda: sink.ok == set(ids), timeout=30)
        assert timelimit.abandoned_threads() == before + 1, "the blocked loop counts against the cap, once"
        assert len(sink.loops) == 2 and not sink.loops[0].is_closed(), "a new loop; the blocked one waits"
    finally:
        release.set()
        adapter.close()
    wait_until(lambda: sink.loops[0].is_closed(), timeout=10, message="the blocked loop closed once its call returned")
    assert timelimit.abandoned_threads() == before
    assert not dead_letters(dsn, NAME)
    assert [c.id for c in sink.calls if c.key == "stuck"] == [ids[0], ids[0], ids[1]]


def test_a_loop_the_sink_stops_runs_on_and_nothing_is_charged(dsn: str, pool: ConnectionPool[Any]) -> None:
    ids = publish(dsn, [("a", "t", {}), ("a", "t", {}), ("b", "t", {})])

    async def script(e: SinkEvent) -> Outcome:
        if e.id == ids[0] and e.attempt == 1:
            asyncio.get_running_loop().stop()
            await asyncio.sleep(0.01)  # resumes: the loop runs on
        return None

    sink = AsyncSink(script)
    r, adapter = user_sink_runner(sink, pool, dsn, handler_timeout_seconds=30.0, max_attempts=2)
    started = time.monotonic()
    try:
        run_until(r, lambda: sink.ok == set(ids), timeout=20)
    finally:
        adapter.close()
    assert time.monotonic() - started < 10, "not after the time limit"
    assert not dead_letters(dsn, NAME) and not parked_ids(dsn, NAME)
    assert [c.id for c in sink.calls if c.key == "a"] == [ids[0], ids[1]], "no attempt charged"
    assert len(sink.loops) == 1 and sink.loops[0].is_closed()


def test_close_cancels_what_runs_on_the_loop_and_closes_it(dsn: str, pool: ConnectionPool[Any]) -> None:
    publish(dsn, [("a", "t", {})])
    entered = threading.Event()
    finished: list[str] = []

    async def background() -> None:  # a task of the sink's own (a client's reader), never awaited by a call
        try:
            await asyncio.sleep(3600)
        finally:
            finished.append("background")

    async def script(e: SinkEvent) -> Outcome:
        asyncio.get_running_loop().create_task(background())
        entered.set()
        try:
            await asyncio.sleep(3600)
        finally:
            finished.append("call")
        return None

    sink = AsyncSink(script)
    r, adapter = user_sink_runner(sink, pool, dsn, handler_timeout_seconds=30.0)
    batch = threading.Thread(target=r.run_once)
    batch.start()
    assert entered.wait(20)
    adapter.close()  # as a relay that leaves does
    assert sorted(finished) == ["background", "call"], "cancelled, and run until they ended"
    assert sink.loops[0].is_closed()
    batch.join(10)
    assert not batch.is_alive()
    parked = fetch_all(dsn, "SELECT attempts FROM outbox.parked WHERE sink = %s", (NAME,))
    assert parked == [(0,)] and not dead_letters(dsn, NAME), "the cancelled call is charged nothing"


def test_at_interpreter_exit_the_loop_is_closed_and_its_tasks_cancelled() -> None:
    script = textwrap.dedent("""
        import asyncio, atexit, threading

        atexit.register(lambda: print("closed" if loop.loop.is_closed() else "open", flush=True))  # runs last

        from outbox_relay.sinks.loop import SinkLoop

        loop = SinkLoop("exit")
        started = threading.Event()

        async def call():
            started.set()
            try:
                await asyncio.sleep(3600)
            finally:
                print("cancelled", flush=True)

        loop.submit(lambda: loop.loop.create_task(call()))
        started.wait(10)
    """)
    done = subprocess.run([sys.executable, "-X", "dev", "-W", "error", "-c", script], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cancelled", "closed"] and done.stderr == ""


def test_each_call_is_traced_under_its_batch(dsn: str, pool: ConnectionPool[Any]) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from outbox_relay.tracing import TracingObserver

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def script(e: SinkEvent) -> Outcome:
        await asyncio.sleep(0)
        return None

    try:
        ids = publish(dsn, [("a", "OrderPlaced", {}), ("a", "OrderShipped", {}), ("b", "OrderPaid", {})])
        observer = TracingObserver(provider)
        adapter = EventSinkAdapter(AsyncSink(script, concurrency=2))
        adapter.observer = observer
        r = runner_for(adapter, pool, make_settings(dsn, "w"))
        r.observer = observer
        try:
            run_until(r, lambda: undelivered(dsn, NAME) == 0)
        finally:
            adapter.close()
    finally:
        provider.shutdown()
    spans = exporter.get_finished_spans()
    calls = [s for s in spans if s.name.startswith("handle ")]
    assert sorted(s.name for s in calls) == ["handle OrderPaid", "handle OrderPlaced", "handle OrderShipped"]
    assert {s.attributes["messaging.message.id"] for s in calls if s.attributes} == {str(i) for i in ids}
    batches = {s.context.span_id for s in spans if not s.name.startswith("handle ")}
    assert all(s.parent is not None and s.parent.span_id in batches for s in calls), "under the batch's span"


class SyncReturningAwaitable:
    """A sink whose ``deliver`` is a plain function returning a coroutine (a wrapper's): lane threads hand each
    call to the sink's loop (``SinkLoop.call``), as before tasks."""

    name = NAME
    kind = "audit"
    concurrency = 2

    def __init__(self, inner: AsyncSink) -> None:
        self.inner = inner

    def deliver(self, event: SinkEvent) -> Any:
        return self.inner.deliver(event)


def test_a_sync_deliver_returning_a_coroutine_keeps_lane_threads_and_the_loop_closes(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    ids = publish(dsn, [(f"k{n % 3}", "t", {"n": n}) for n in range(12)])
    hung = ids[4]

    async def script(e: SinkEvent) -> Outcome:
        if e.id == hung and e.attempt == 1:
            await asyncio.sleep(3600)  # cancelled at the time limit
        await asyncio.sleep(0)
        return None

    inner = AsyncSink(script)
    r, adapter = user_sink_runner(SyncReturningAwaitable(inner), pool, dsn, handler_timeout_seconds=0.5)
    try:
        run_until(r, lambda: inner.ok == set(ids), timeout=30)
        assert lane_threads(), "a sync deliver keeps its lane threads"
    finally:
        adapter.close()
    assert inner.threads == {LOOP_THREAD} and inner.loops[0].is_closed()
    assert [c.id for c in inner.calls].count(hung) == 2 and not dead_letters(dsn, NAME)


def test_a_call_handed_to_a_stopped_loop_is_closed_never_awaited() -> None:
    from outbox_relay.sinks.loop import SinkLoop

    sink_loop = SinkLoop(NAME)
    assert sink_loop.stop(5.0), "stopped and closed"

    async def never() -> None:
        raise AssertionError("never run")

    future = sink_loop.call(never(), contextvars.copy_context())
    assert future.cancelled() and not sink_loop.submit(lambda: None)
