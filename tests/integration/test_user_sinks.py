"""Issue 17 item 1: a user's own sink (outbox_relay.sinks) under the real engine, against real PostgreSQL.

The adapter (outbox_relay/sinks/adapter.py) keeps every guarantee for it: per-key order (also with
``concurrency`` > 1), Retry parks the key (at least ``after_seconds``), GiveUp dead-letters at once,
SinkUnavailable holds without counting attempts, an exception is a retry, a call that never returns
is abandoned after the time limit while other keys go on.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import Relay
from outbox_relay.errors import OutboxError
from outbox_relay.observer import Observer
from outbox_relay.sinks import Delivered, GiveUp, Outcome, Retry, SinkEvent, SinkUnavailable
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

NAME = "audit"


class ScriptedSink:
    """A user sink whose answer per call is ``script(event)``; records every call (thread-safe)."""

    kind = "audit"

    def __init__(self, script: Callable[[SinkEvent], Outcome] | None = None, *, name: str = NAME,
                 concurrency: int = 1) -> None:
        self.name = name
        self.concurrency = concurrency
        self.script = script
        self.calls: list[SinkEvent] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0
        self.ok: set[uuid.UUID] = set()  # events a call delivered

    def deliver(self, event: SinkEvent) -> Outcome:
        with self.lock:
            self.calls.append(event)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            result = self.script(event) if self.script is not None else None
            if result is None or isinstance(result, Delivered):
                with self.lock:
                    self.ok.add(event.id)
            return result
        finally:
            with self.lock:
                self.in_flight -= 1

    def delivered_per_key(self, ok: Callable[[SinkEvent], bool] | None = None) -> dict[str, list[uuid.UUID]]:
        """Per key, the ids of calls ``ok`` says were delivered (default: every call), first time each."""
        out: dict[str, list[uuid.UUID]] = defaultdict(list)
        seen: set[uuid.UUID] = set()
        with self.lock:
            for e in self.calls:
                if e.id not in seen and (ok is None or ok(e)):
                    seen.add(e.id)
                    out[e.key].append(e.id)
        return dict(out)


def per_key(ids: list[uuid.UUID], keys: list[str]) -> dict[str, list[uuid.UUID]]:
    out: dict[str, list[uuid.UUID]] = defaultdict(list)
    for i, k in zip(ids, keys, strict=True):
        out[k].append(i)
    return dict(out)


def test_a_user_sink_of_its_own_kind_gets_every_event_in_order_under_a_worker(dsn: str) -> None:
    keys = [f"k{i % 4}" for i in range(40)]
    ids = publish(dsn, [(k, "OrderPlaced", {"n": n}) for n, k in enumerate(keys)])
    sink = ScriptedSink()
    worker = Worker(make_settings(dsn, "w"), sinks=[EventSinkAdapter(sink)])
    with running(worker):
        wait_until(lambda: len(sink.calls) >= 40, timeout=20, message="every event delivered")
    assert sink.delivered_per_key() == per_key(ids, keys)
    first = sink.calls[0]
    assert first.attempt == 1 and first.type == "OrderPlaced" and first.payload == {"n": 0}
    assert first.payload_json == '{"n": 0}' and first.topic == "relay-test" and dict(first.headers) == {}
    assert fetch_all(dsn, "SELECT kind FROM outbox.sinks WHERE name = %s", (NAME,)) == [("audit",)]


def test_retry_parks_its_key_for_at_least_after_seconds_while_other_keys_go_on(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    ids = publish(dsn, [("a", "t", {"n": 1}), ("a", "t", {"n": 2}), ("b", "t", {"n": 3})])
    first_try: dict[uuid.UUID, float] = {}

    def script(e: SinkEvent) -> Outcome:
        if e.id == ids[0] and e.attempt == 1:
            first_try[e.id] = time.monotonic()
            return Retry("busy", after_seconds=1.0)
        return Delivered()

    sink = ScriptedSink(script)
    r, _ = user_sink_runner(sink, pool, dsn)
    run_until(r, lambda: {ids[0], ids[2]} <= {c.id for c in sink.calls})
    assert sorted(c.id for c in sink.calls) == sorted([ids[0], ids[2]]), "the key waits behind its retry; b goes on"
    assert parked_ids(dsn, NAME) == {ids[0], ids[1]}
    retry_at = fetch_all(dsn, "SELECT available_at - clock_timestamp() FROM outbox.parked WHERE event_id = %s",
                         (ids[0],))[0][0]
    assert retry_at.total_seconds() > 0.7, "after_seconds is a floor over the relay's (tiny) backoff"
    run_until(r, lambda: len(sink.calls) == 4, timeout=10)
    assert [c.id for c in sink.calls[2:]] == [ids[0], ids[1]] and sink.calls[2].attempt == 2
    assert time.monotonic() - first_try[ids[0]] >= 1.0
    assert not parked_ids(dsn, NAME)


def test_give_up_dead_letters_at_once_and_the_key_goes_on(dsn: str, pool: ConnectionPool[Any]) -> None:
    ids = publish(dsn, [("a", "t", {"n": 1}), ("a", "t", {"n": 2})])
    sink = ScriptedSink(lambda e: GiveUp("HTTP 400: bad payload") if e.id == ids[0] else None)
    r, _ = user_sink_runner(sink, pool, dsn, max_attempts=5)
    run_until(r, lambda: len(sink.calls) == 2)
    assert [c.id for c in sink.calls] == ids
    assert dead_letters(dsn, NAME) == {ids[0]: (1, "HTTP 400: bad payload")}


def test_an_exception_is_a_retry_and_dead_letters_past_max_attempts(dsn: str, pool: ConnectionPool[Any]) -> None:
    ids = publish(dsn, [("a", "t", {"n": 1}), ("a", "t", {"n": 2})])

    def script(e: SinkEvent) -> Outcome:
        if e.id == ids[0]:
            raise ConnectionError("refused")
        return None

    sink = ScriptedSink(script)
    r, _ = user_sink_runner(sink, pool, dsn, max_attempts=3)
    run_until(r, lambda: ids[1] in {c.id for c in sink.calls}, timeout=10)
    assert [(c.id, c.attempt) for c in sink.calls] == [(ids[0], 1), (ids[0], 2), (ids[0], 3), (ids[1], 1)]
    assert dead_letters(dsn, NAME) == {ids[0]: (3, "ConnectionError: refused")}


def test_sink_unavailable_holds_the_batch_without_counting_attempts(dsn: str, pool: ConnectionPool[Any]) -> None:
    ids = publish(dsn, [("a", "t", {}), ("b", "t", {}), ("c", "t", {})])
    down = threading.Event()
    down.set()

    def script(e: SinkEvent) -> Outcome:
        if down.is_set():
            raise SinkUnavailable("the endpoint is down", retry_after_seconds=0.3)
        return None

    sink = ScriptedSink(script)
    r, _ = user_sink_runner(sink, pool, dsn, max_attempts=2)
    run_until(r, lambda: len(parked_ids(dsn, NAME)) == 3)
    assert len(sink.calls) == 1, "one call said the sink is down: the rest of the batch was not attempted"
    rows = fetch_all(dsn, "SELECT attempts, last_error FROM outbox.parked WHERE sink = %s", (NAME,))
    assert all(attempts == 0 for attempts, _ in rows), "no attempt counted"
    assert any("the endpoint is down" in (error or "") for _, error in rows)
    for _ in range(3):  # more than max_attempts rounds while it is down: nothing is dead-lettered
        calls = len(sink.calls)
        run_until(r, lambda calls=calls: len(sink.calls) > calls, timeout=10)  # type: ignore[misc]
    assert not dead_letters(dsn, NAME)
    down.clear()
    run_until(r, lambda: not parked_ids(dsn, NAME), timeout=10)
    assert {c.id for c in sink.calls[-3:]} == set(ids) and all(c.attempt == 1 for c in sink.calls)


def test_a_call_that_never_returns_is_abandoned_and_charged_while_other_keys_go_on(
        dsn: str, pool: ConnectionPool[Any], release: threading.Event) -> None:
    ids = publish(dsn, [("stuck", "t", {}), ("stuck", "t", {}), ("b", "t", {}), ("c", "t", {})])

    def script(e: SinkEvent) -> Outcome:
        if e.id == ids[0] and e.attempt == 1:
            release.wait()  # never returns during the test
        return None

    sink = ScriptedSink(script)
    r, _ = user_sink_runner(sink, pool, dsn, handler_timeout_seconds=0.5)
    run_until(r, lambda: {ids[2], ids[3]} <= {c.id for c in sink.calls} and ids[0] in parked_ids(dsn, NAME))
    rows = fetch_all(dsn, "SELECT attempts, last_error FROM outbox.parked WHERE event_id = %s", (ids[0],))
    assert rows[0][0] == 1 and "did not return within 0.5s" in rows[0][1]
    run_until(r, lambda: not parked_ids(dsn, NAME), timeout=10)
    later = [c.id for c in sink.calls if c.key == "stuck"]
    assert later == [ids[0], ids[0], ids[1]], "retried, then the key's next event, in order"


def test_concurrency_delivers_keys_at_once_and_keeps_each_keys_order(dsn: str) -> None:
    keys = [f"k{i % 8}" for i in range(160)]
    ids = publish(dsn, [(k, "t", {"n": n}) for n, k in enumerate(keys)])
    rnd = random.Random(7)

    def script(e: SinkEvent) -> Outcome:
        time.sleep(0.002)
        return Retry("flaky") if rnd.random() < 0.1 and e.attempt == 1 else None

    sink = ScriptedSink(script, concurrency=4)
    worker = Worker(make_settings(dsn, "w"), sinks=[EventSinkAdapter(sink)])
    with running(worker):
        wait_until(lambda: sink.ok == set(ids), timeout=30, message="every event delivered")

    assert sink.most_in_flight > 1, "keys were delivered at once"
    seen: dict[str, list[uuid.UUID]] = defaultdict(list)
    for c in sink.calls:  # per key, calls never go backwards: a retry repeats the head, never skips it
        ks = seen[c.key]
        if not ks or ks[-1] != c.id:
            ks.append(c.id)
    assert seen == per_key(ids, keys)


# -- embedding (issue 17 item 5) ----------------------------------------------------------------


class Checkpoints(Observer):
    """What ``Observer.checkpointed`` told, per relay."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.delivered: list[uuid.UUID] = []
        self.dead: list[uuid.UUID] = []

    def checkpointed(self, sink: str, *, delivered: Sequence[uuid.UUID], dead: Sequence[uuid.UUID]) -> None:
        with self.lock:
            self.delivered.extend(delivered)
            self.dead.extend(dead)


def test_two_embedded_relays_split_the_keys_and_report_each_checkpoint(dsn: str) -> None:
    sinks = [ScriptedSink(lambda e: GiveUp("no") if e.payload["n"] == 3 else None) for _ in range(2)]
    seen = [Checkpoints(), Checkpoints()]
    relays = [Relay(make_settings(dsn, f"embedded-{i}"), sinks=[sinks[i]], observer=seen[i]) for i in range(2)]
    for relay in relays:
        relay.start()
    try:
        wait_until(lambda: all(r.readiness() == [] for r in relays)
                   and sum(len(leased(dsn, f"embedded-{i}")) for i in range(2)) == 256, timeout=30,
                   message="both relays hold their share")
        assert all(len(leased(dsn, f"embedded-{i}")) > 0 for i in range(2))
        ids = publish(dsn, [(f"k{n % 40}", "t", {"n": n}) for n in range(200)])
        wait_until(lambda: len(seen[0].delivered) + len(seen[1].delivered) == 199, timeout=30,
                   message="every checkpoint reported")
    finally:
        assert all(relay.drain(30) for relay in relays)
    assert not any(relay.running for relay in relays) and all(relay.fatal is None for relay in relays)
    assert sorted(seen[0].delivered + seen[1].delivered) == sorted(ids[:3] + ids[4:])
    assert seen[0].dead + seen[1].dead == [ids[3]]
    assert all(s.calls for s in sinks), "each relay delivered its share"
    assert set(seen[0].delivered) == sinks[0].ok and set(seen[1].delivered) == sinks[1].ok


def leased(dsn: str, worker: str) -> list[int]:
    return [r[0] for r in fetch_all(dsn, "SELECT bucket FROM outbox.cursors WHERE sink = %s AND owner = %s",
                                    (NAME, worker))]


def test_an_embedded_relay_as_a_context_manager_delivers_and_drains(dsn: str) -> None:
    sink = ScriptedSink()
    with Relay(make_settings(dsn, "embedded"), sinks=[sink]) as relay:
        ids = publish(dsn, [("k", "t", {"n": n}) for n in range(5)])
        wait_until(lambda: sink.ok == set(ids), timeout=20, message="delivered")
        assert relay.running and relay.health() == []
    assert not relay.running
    with pytest.raises(OutboxError, match="started already"):
        relay.start()


def test_a_long_batch_checkpoints_what_is_delivered_while_a_slow_call_runs(
        dsn: str, pool: ConnectionPool[Any], release: threading.Event) -> None:
    ids = publish(dsn, [("slow", "t", {})] + [(f"k{i}", "t", {}) for i in range(20)])

    def script(e: SinkEvent) -> Outcome:
        if e.id == ids[0]:
            release.wait(30)  # slow, not stuck: returns once the test saw the early checkpoint
        return None

    sink = ScriptedSink(script, concurrency=2)
    adapter = EventSinkAdapter(sink)
    adapter.partial_seconds = 0.2
    r, _ = user_sink_runner(adapter, pool, dsn)
    done = threading.Thread(target=run_until, args=(r, lambda: sink.ok == set(ids)), kwargs={"timeout": 40})
    done.start()
    try:
        wait_until(lambda: undelivered(dsn, NAME) == 1, timeout=20,
                   message="the other keys' events checkpointed while the slow call runs")
        assert ids[0] not in sink.ok
    finally:
        release.set()
        done.join(40)
    assert undelivered(dsn, NAME) == 0


def test_a_hard_stop_leaves_the_call_in_flight_and_checkpoints_nothing_of_its_batch(
        dsn: str, release: threading.Event) -> None:
    ids = publish(dsn, [("k", "t", {"n": n}) for n in range(3)])
    entered = threading.Event()

    def script(e: SinkEvent) -> Outcome:
        entered.set()
        release.wait(60)
        return None

    sink = ScriptedSink(script)
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
    assert len(sink.calls) == 1 and sink.calls[0].id == ids[0]


def test_readiness_says_the_sink_is_unavailable(dsn: str, pool: ConnectionPool[Any]) -> None:
    publish(dsn, [("k", "t", {})])

    def down(e: SinkEvent) -> Outcome:
        raise SinkUnavailable("endpoint answers 503", retry_after_seconds=60)

    adapter = EventSinkAdapter(ScriptedSink(down))
    r, _ = user_sink_runner(adapter, pool, dsn)
    run_until(r, lambda: bool(parked_ids(dsn, NAME)))
    problem = adapter.problem()
    assert problem is not None and problem.startswith("unavailable: endpoint answers 503 (its events wait, ")


def test_each_call_is_traced_under_its_batch(dsn: str, pool: ConnectionPool[Any]) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from outbox_relay.tracing import TracingObserver

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        ids = publish(dsn, [("a", "OrderPlaced", {}), ("b", "OrderPaid", {})])
        observer = TracingObserver(provider)
        adapter = EventSinkAdapter(ScriptedSink(concurrency=2))
        adapter.observer = observer
        r, _ = user_sink_runner(adapter, pool, dsn)
        r.observer = observer
        run_until(r, lambda: undelivered(dsn, NAME) == 0)
    finally:
        provider.shutdown()
    spans = exporter.get_finished_spans()
    calls = [s for s in spans if s.name.startswith("handle ")]
    assert sorted(s.name for s in calls) == ["handle OrderPaid", "handle OrderPlaced"]
    assert {s.attributes["messaging.message.id"] for s in calls if s.attributes} == {str(i) for i in ids}
    batches = {s.context.span_id for s in spans if not s.name.startswith("handle ")}
    assert all(s.parent is not None and s.parent.span_id in batches for s in calls), "under the batch's span"


class AsyncClientSink:
    """An async sink holding one client for all its calls (here an asyncio.Lock and a semaphore, bound
    to the event loop that first uses them, as an HTTP session is): every call must run on that loop."""

    name = NAME
    kind = "audit"
    concurrency = 4

    def __init__(self, hang: uuid.UUID | None = None) -> None:
        self.client: tuple[asyncio.Lock, asyncio.Semaphore] | None = None
        self.got: list[uuid.UUID] = []
        self.hang = hang
        self.cancelled = threading.Event()

    async def deliver(self, event: SinkEvent) -> None:
        if self.client is None:
            self.client = (asyncio.Lock(), asyncio.Semaphore(2))
        lock, slots = self.client
        if event.id == self.hang and event.attempt == 1:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        async with slots:
            await asyncio.sleep(0.001)
            async with lock:
                self.got.append(event.id)


def test_an_async_sink_runs_every_call_on_one_loop_and_a_stuck_call_is_cancelled(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    keys = [f"k{i % 8}" for i in range(48)]
    ids = publish(dsn, [(k, "t", {"n": n}) for n, k in enumerate(keys)])
    sink = AsyncClientSink(hang=ids[5])
    adapter = EventSinkAdapter(sink, handler_timeout_seconds=0.5)
    r, _ = user_sink_runner(adapter, pool, dsn)
    try:
        run_until(r, lambda: undelivered(dsn, NAME) == 0 and not parked_ids(dsn, NAME), timeout=30)
    finally:
        adapter.close()
    assert not dead_letters(dsn, NAME)
    assert sink.cancelled.is_set(), "the abandoned coroutine was cancelled, not left running"
    got: dict[str, list[uuid.UUID]] = defaultdict(list)
    for i in sink.got:
        got[dict(zip(ids, keys, strict=True))[i]].append(i)
    assert dict(got) == per_key(ids, keys)
