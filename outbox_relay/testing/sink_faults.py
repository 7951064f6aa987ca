"""A contract test suite for a sink you wrote: inherit, say how to make your sink, run pytest.

    from outbox_relay.testing import SinkContract

    class TestAuditSink(SinkContract):
        def make_sink(self):
            return AuditSink(path=self.tmp / "audit.jsonl")

        def received(self, sink):            # optional: what your downstream really got, in order
            return [json.loads(line)["id"] for line in (self.tmp / "audit.jsonl").read_text().splitlines()]

Every test drives the real relay engine (``SinkRunner``, the runner ``outbox-relay run`` uses, with
the real adapter around your sink) against a real PostgreSQL: a fresh database per test from the
``dsn`` fixture if your tests have one, else from ``OUTBOX_TEST_DSN`` (a server where the test may
create databases), else a private PostgreSQL 18 (``outbox-relay[embedded]``).

What the tests check, on the events your downstream received (``received``; by default the events
your ``deliver`` answered delivered for):

- every event arrives, in publish order per key, with several keys and transactions;
- order holds under failures: the kit answers for your sink on chosen attempts (``Retry``, ``GiveUp``,
  an exception, ``SinkUnavailable``, a call that never returns) and lets the others through to it;
- ``Retry`` parks the key (at least ``after_seconds``) and the event comes again with ``attempt`` 2;
  ``GiveUp`` dead-letters at once and the key goes on; ``SinkUnavailable`` holds without counting
  attempts (never dead-letters); an exception is a retry; a call past the time limit is abandoned,
  charged, and the other keys go on;
- redelivery after a crash (a relay that delivered but died before its checkpoint): your sink gets
  the events again and must take them (duplicates allowed, never a reorder, nothing dead-lettered);
- optional, when you implement ``break_downstream``: your sink's own answers while its downstream is
  down, rejects, or hangs.

The same suite runs against the engine's own sinks (an object with ``deliver(events, fences, commit,
abort)``: Kafka, projections, ``RecordingSink``); the tests about exceptions and the time limit are
an ``EventSink`` adapter's and are skipped for them (tests/integration/test_sink_contract.py).
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import ConnectionPool

from .. import store
from ..migrate import migrate
from ..publish import Outbox
from ..relay import SinkRunner
from ..settings import load_settings
from ..sinks import Delivered, GiveUp, Retry, SinkEvent, SinkUnavailable, check_sink
from ..sinks.adapter import EventSinkAdapter
from ..sinks.engine import Commit, Failure, KeyHold, Outcomes
from ..store import StoredEvent

__all__ = ["SinkContract"]

# What the kit answers for the sink on a planned attempt (``_Plan``).
RETRY, GIVE_UP, RAISE, UNAVAILABLE, HANG = "retry", "give_up", "raise", "unavailable", "hang"


class _Plan:
    """Per event id, what the kit answers on its next calls instead of the sink (one entry per call;
    calls, not attempts: ``SinkUnavailable`` counts no attempt)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.faults: dict[uuid.UUID, list[str]] = {}
        self.release = threading.Event()  # lets HANG calls return at the end of a test

    def set(self, event_id: uuid.UUID, *faults: str) -> None:
        with self.lock:
            self.faults[event_id] = list(faults)

    def fault(self, event_id: uuid.UUID) -> str | None:
        with self.lock:
            planned = self.faults.get(event_id)
            return planned.pop(0) if planned else None


class _Recorder:
    """What the engine was told was delivered, in order (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ids: list[uuid.UUID] = []

    def add(self, ids: Sequence[uuid.UUID]) -> None:
        with self.lock:
            self.ids.extend(ids)

    def snapshot(self) -> list[uuid.UUID]:
        with self.lock:
            return list(self.ids)


class _FaultyEventSink:
    """The user's EventSink with the kit's planned answers in front of it."""

    def __init__(self, inner: Any, plan: _Plan, recorder: _Recorder) -> None:
        self.inner, self.plan, self.recorder = inner, plan, recorder
        self.name, self.kind = inner.name, inner.kind
        self.topics = getattr(inner, "topics", None)
        self.types = getattr(inner, "types", None)
        self.concurrency = getattr(inner, "concurrency", 1)

    def deliver(self, event: SinkEvent) -> Any:
        fault = self.plan.fault(event.id)
        if fault == RETRY:
            return Retry("contract: planned retry", after_seconds=0.3)
        if fault == GIVE_UP:
            return GiveUp("contract: planned give-up")
        if fault == RAISE:
            raise RuntimeError("contract: planned exception")
        if fault == UNAVAILABLE:
            raise SinkUnavailable("contract: planned outage", retry_after_seconds=0.2)
        if fault == HANG:
            self.plan.release.wait()
            return None
        result = self.inner.deliver(event)
        if inspect.isawaitable(result):
            return self._recorded_async(event, result)
        self._record(event, result)
        return result

    async def _recorded_async(self, event: SinkEvent, awaitable: Any) -> Any:
        result = await awaitable
        self._record(event, result)
        return result

    def _record(self, event: SinkEvent, result: Any) -> None:
        if result is None or isinstance(result, Delivered):
            self.recorder.add([event.id])

    def idle(self) -> None:
        idle = getattr(self.inner, "idle", None)
        if idle is not None:
            idle()

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


class _FaultyCommit:
    """The runner's commit with the kit's planned outcomes merged in; records what landed."""

    def __init__(self, commit: Commit, planned: Outcomes, recorder: _Recorder, events: Sequence[StoredEvent]) -> None:
        self.commit, self.planned, self.recorder = commit, planned, recorder
        self.bucket = {e.id: e.bucket for e in events}

    def partial(self, outcomes: Outcomes) -> set[int]:
        return self.commit.partial({**outcomes, **self.planned})

    def later(self, outcomes: Outcomes) -> set[int]:
        return self(outcomes, None)  # at once: what landed is recorded

    def __call__(self, outcomes: Outcomes, tx: Any) -> set[int]:
        landed = self.commit({**outcomes, **self.planned}, tx)
        self._record(outcomes, landed)
        return landed

    async def in_async(self, outcomes: Outcomes, tx: Any) -> set[int]:
        landed = await self.commit.in_async({**outcomes, **self.planned}, tx)
        self._record(outcomes, landed)
        return landed

    def _record(self, outcomes: Outcomes, landed: set[int]) -> None:
        self.recorder.add([i for i, o in outcomes.items() if o is None and self.bucket.get(i) in landed])


class _FaultyEngineSink:
    """An engine ``Sink`` (Kafka, projections, RecordingSink) with the kit's planned failures: a planned
    event is answered by the kit (and its key's later events of the batch left out, as the sink would),
    the rest goes to the sink."""

    def __init__(self, inner: Any, plan: _Plan, recorder: _Recorder) -> None:
        self.inner, self.plan, self.recorder = inner, plan, recorder
        self.name, self.kind, self.event_filter = inner.name, inner.kind, inner.event_filter

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        planned: Outcomes = {}
        hold = KeyHold()
        passed: list[StoredEvent] = []
        for e in events:
            if not hold.allows(e):
                continue  # behind a planned failure of its key: the sink never sees it
            fault = self.plan.fault(e.id)
            if fault is None:
                passed.append(e)
                continue
            failure = {RETRY: Failure("contract: planned retry", retry_after=0.3),
                       GIVE_UP: Failure("contract: planned give-up", retriable=False),
                       UNAVAILABLE: Failure("contract: planned outage", hold_seconds=0.2)}[fault]
            planned[e.id] = failure
            hold.record(e, failure)
        landed: set[int] = self.inner.deliver(passed, fences, _FaultyCommit(commit, planned, self.recorder, events),
                                              abort)
        return landed

    def idle(self) -> None:
        idle = getattr(self.inner, "idle", None)
        if idle is not None:
            idle()

    def close(self) -> None:
        self.inner.close()


def _is_engine_sink(sink: Any) -> bool:
    deliver = getattr(sink, "deliver", None)
    return deliver is not None and len(inspect.signature(deliver).parameters) == 4


_server: Any = None  # the private PostgreSQL of this process, when the kit started one


def _server_dsn() -> str:
    """A server where the kit may create databases: OUTBOX_TEST_DSN, else a private PostgreSQL 18."""
    import os

    given = os.environ.get("OUTBOX_TEST_DSN")
    if given:
        return given
    global _server
    if _server is None:
        from ..private_servers import EmbeddedPostgres

        _server = EmbeddedPostgres().start()
        atexit.register(_server.stop)
    return str(_server.dsn)


@contextlib.contextmanager
def _fresh_database(server: str) -> Iterator[str]:
    name = f"sink_contract_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(server, dbname=name)
    try:
        yield dsn
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class SinkContract:
    """The contract suite. Override ``make_sink``; the other hooks are optional."""

    topic = "contract"  # the events' topic
    event_type = "contract.Happened"  # the events' type
    handler_timeout_seconds = 1.0  # the time limit the hang test uses
    settle_seconds = 30.0  # how long a test waits for delivery to finish

    # -- hooks --------------------------------------------------------------------------------

    def make_sink(self) -> Any:
        """A new sink to test: an ``EventSink`` (or an engine ``Sink``). Called once per test."""
        raise NotImplementedError("override make_sink() to return the sink under test")

    def prepare_database(self, dsn: str) -> None:
        """Called with the test's fresh, migrated database before ``make_sink`` (tables a sink needs)."""

    def received(self, sink: Any) -> Sequence[uuid.UUID] | None:
        """The ids your downstream received, in the order it received them (repeats allowed). None (the
        default): the ids the engine was told were delivered."""
        return None

    def break_downstream(self, sink: Any, how: str) -> contextlib.AbstractContextManager[None]:
        """While the returned context is open your downstream is ``how``: "down" (unreachable), "rejects"
        (refuses every event for good, e.g. HTTP 400) or "hangs" (never answers). Not implemented: the
        tests that need it are skipped."""
        pytest.skip(f"break_downstream({how!r}) is not implemented for this sink")

    # -- fixtures -----------------------------------------------------------------------------

    @pytest.fixture(name="contract_dsn")
    def _contract_dsn(self, request: pytest.FixtureRequest) -> Iterator[str]:
        try:
            dsn = str(request.getfixturevalue("dsn"))
        except pytest.FixtureLookupError:
            with _fresh_database(_server_dsn()) as fresh:
                migrate(fresh)
                yield fresh
            return
        migrate(dsn)
        yield dsn

    @pytest.fixture(name="contract")
    def _contract(self, contract_dsn: str) -> Iterator[_Harness]:
        self.prepare_database(contract_dsn)
        harness = _Harness(self, contract_dsn)
        try:
            yield harness
        finally:
            harness.close()

    # -- the tests ----------------------------------------------------------------------------

    def test_sink_keeps_the_contract_shape(self, contract: _Harness) -> None:
        sink = contract.sink
        if _is_engine_sink(sink):
            assert isinstance(sink.name, str) and isinstance(sink.kind, str) and callable(sink.close)
        else:
            check_sink(sink)

    def test_every_event_arrives_in_order_per_key(self, contract: _Harness) -> None:
        published = contract.publish(keys=5, per_key=6, transactions=3)
        runner = contract.runner()
        contract.run_until_settled(runner)
        assert contract.dead_letters() == {}
        contract.assert_in_order(published)

    def test_order_holds_under_failures(self, contract: _Harness) -> None:
        published = contract.publish(keys=4, per_key=5, transactions=2)
        flat = [i for ids in published.values() for i in ids]
        faults = [RETRY, UNAVAILABLE, RETRY] + ([] if contract.engine else [RAISE])
        for n, event_id in enumerate(flat[::3]):
            contract.plan.set(event_id, faults[n % len(faults)])
        given_up = flat[4]
        contract.plan.set(given_up, GIVE_UP)
        contract.run_until_settled(contract.runner(max_attempts=5))
        assert set(contract.dead_letters()) == {given_up}
        contract.assert_in_order(published, without={given_up})

    def test_retry_parks_its_key_and_comes_again(self, contract: _Harness) -> None:
        first, second = contract.publish(keys=1, per_key=2)["k0"]
        contract.plan.set(first, RETRY)
        runner = contract.runner()
        contract.run_until(runner, lambda: contract.parked().get(first, (0, None))[0] == 1)
        assert contract.parked_for(first) >= 0.15, "Retry(after_seconds=0.3) is a floor on the park"
        assert second not in contract.delivered_ids(), "the key waits behind its retry"
        contract.run_until_settled(runner)
        contract.assert_in_order({"k0": [first, second]})

    def test_give_up_dead_letters_at_once_and_the_key_goes_on(self, contract: _Harness) -> None:
        first, second = contract.publish(keys=1, per_key=2)["k0"]
        contract.plan.set(first, GIVE_UP)
        contract.run_until_settled(contract.runner(max_attempts=5))
        dead = contract.dead_letters()
        assert list(dead) == [first] and dead[first][0] == 1 and "give-up" in dead[first][1]
        contract.assert_in_order({"k0": [second]})

    def test_unavailable_holds_without_counting_attempts(self, contract: _Harness) -> None:
        ids = contract.publish(keys=2, per_key=2)
        head = ids["k0"][0]
        contract.plan.set(head, UNAVAILABLE, UNAVAILABLE, UNAVAILABLE)  # more outages than max_attempts
        contract.run_until_settled(contract.runner(max_attempts=2))
        assert contract.dead_letters() == {}
        contract.assert_in_order(ids)

    def test_an_exception_is_a_retry(self, contract: _Harness) -> None:
        if contract.engine:
            pytest.skip("an engine sink's exception fails its batch as a whole (the engine then isolates the "
                        "event); per-event exceptions are the EventSink adapter's rule")
        first, second = contract.publish(keys=1, per_key=2)["k0"]
        contract.plan.set(first, RAISE, RAISE)
        contract.run_until_settled(contract.runner(max_attempts=5))
        assert contract.dead_letters() == {}
        contract.assert_in_order({"k0": [first, second]})

    def test_a_call_past_the_time_limit_is_abandoned_and_the_other_keys_go_on(self, contract: _Harness) -> None:
        if contract.engine:
            pytest.skip("the time limit of an engine sink is its own (projections: guard.py; Kafka: stall)")
        ids = contract.publish(keys=3, per_key=2)
        stuck = ids["k0"][0]
        contract.plan.set(stuck, HANG)
        runner = contract.runner(handler_timeout_seconds=self.handler_timeout_seconds)
        contract.run_until(runner, lambda: contract.parked().get(stuck, (0, None))[0] == 1)
        error = contract.parked()[stuck][1] or ""
        assert "did not return" in error, error
        contract.run_until_settled(runner)
        contract.assert_in_order(ids)

    def test_redelivery_after_a_crash_is_taken(self, contract: _Harness) -> None:
        published = contract.publish(keys=3, per_key=4, transactions=2)
        first = contract.runner()  # registers the sink: its cursors stand before every event
        before = contract.cursors()
        assert before, "the sink's cursors exist once it is registered"
        contract.run_until_settled(first)
        contract.crash_before_checkpoint(before)
        contract.run_until_settled(contract.runner(worker_id="contract-2"))
        assert contract.dead_letters() == {}
        contract.assert_in_order(published)
        again = contract.delivered_ids()
        assert all(again.count(i) >= 2 for ids in published.values() for i in ids), \
            "every event was delivered again after the crash"

    def test_downstream_down_then_back(self, contract: _Harness) -> None:
        ids = contract.publish(keys=3, per_key=3)
        runner = contract.runner(max_attempts=100)
        with self.break_downstream(contract.sink, "down"):
            for _ in range(5):
                runner.run_once()
                time.sleep(0.05)
            assert contract.dead_letters() == {}
            assert not set(contract.delivered_ids()) & {i for v in ids.values() for i in v}
        contract.run_until_settled(runner)
        contract.assert_in_order(ids)

    def test_downstream_rejects_dead_letter_with_a_reason(self, contract: _Harness) -> None:
        contract.publish(keys=1, per_key=2)
        runner = contract.runner(max_attempts=3)
        with self.break_downstream(contract.sink, "rejects"):
            contract.run_until(runner, lambda: len(contract.dead_letters()) == 2)
        assert all(error for _, error in contract.dead_letters().values())

    def test_downstream_hangs_then_recovers(self, contract: _Harness) -> None:
        ids = contract.publish(keys=2, per_key=2)
        runner = contract.runner(max_attempts=100, handler_timeout_seconds=self.handler_timeout_seconds)
        with self.break_downstream(contract.sink, "hangs"):
            contract.run_until(runner, lambda: any(n >= 1 for n, _ in contract.parked().values()))
        contract.run_until_settled(runner)
        assert contract.dead_letters() == {}
        contract.assert_in_order(ids)


class _Harness:
    """One test's database, sink (with the kit's planned failures in front of it) and runners."""

    def __init__(self, suite: SinkContract, dsn: str) -> None:
        self.suite, self.dsn = suite, dsn
        self.sink = suite.make_sink()
        self.engine = _is_engine_sink(self.sink)
        self.plan = _Plan()
        self.recorder = _Recorder()
        self.custom_received = False
        self.faulty: Any = (_FaultyEngineSink if self.engine else _FaultyEventSink)(self.sink, self.plan, self.recorder)
        self.pool: ConnectionPool[Any] = ConnectionPool(dsn, min_size=1, max_size=4, open=True,
                                                        kwargs={"autocommit": True})
        self.adapter: EventSinkAdapter | None = None

    def close(self) -> None:
        self.plan.release.set()
        with contextlib.suppress(Exception):
            (self.adapter or self.faulty).close()
        self.pool.close()

    def name(self) -> str:
        return str(self.sink.name)

    # -- publishing and running -----------------------------------------------------------

    def publish(self, *, keys: int, per_key: int, transactions: int = 1) -> dict[str, list[uuid.UUID]]:
        """``per_key`` events for each of ``keys`` keys, interleaved, in ``transactions`` transactions."""
        outbox = Outbox(default_topic=self.suite.topic)
        rows = [(f"k{k}", n) for n in range(per_key) for k in range(keys)]
        out: dict[str, list[uuid.UUID]] = defaultdict(list)
        step = max(1, -(-len(rows) // transactions))
        with psycopg.connect(self.dsn) as conn:
            for start in range(0, len(rows), step):
                with conn.transaction():
                    published = outbox.publish_many(conn, [
                        {"key": key, "type": self.suite.event_type, "payload": {"key": key, "n": n}}
                        for key, n in rows[start:start + step]])
                for (key, _), p in zip(rows[start:start + step], published, strict=True):
                    out[key].append(p.id)
        return dict(out)

    def runner(self, *, worker_id: str = "contract", max_attempts: int = 10,
               handler_timeout_seconds: float = 30.0) -> SinkRunner:
        settings = load_settings(
            dsn=self.dsn, worker_id=worker_id, kafka=False, listen=False, poll_seconds=0.05,
            backoff_base_seconds=0.01, backoff_max_seconds=0.05, max_attempts=max_attempts,
            handler_timeout_seconds=handler_timeout_seconds, heartbeat_seconds=0.2, worker_ttl_seconds=1.0)
        sink = self.faulty
        if not self.engine:  # one adapter per test (its close closes the user's sink), its limit per runner
            self.adapter = self.adapter or EventSinkAdapter(self.faulty)
            self.adapter.timeout = handler_timeout_seconds
            sink = self.adapter
        with self.pool.connection() as conn:
            store.register_sink(conn, sink.name, sink.kind)
        runner = SinkRunner(sink, self.pool, settings)
        runner.desired = set(range(256))
        return runner

    def run_until(self, runner: SinkRunner, predicate: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.suite.settle_seconds
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"sink {self.name()}: not reached within {self.suite.settle_seconds:g}s: "
                                     f"parked {self.parked()}, dead letters {self.dead_letters()}, "
                                     f"{self.undelivered()} undelivered")
            runner.run_once()
            time.sleep(0.01)

    def run_until_settled(self, runner: SinkRunner) -> None:
        """Until nothing of the sink is undelivered or parked."""
        self.run_until(runner, lambda: self.undelivered() == 0 and not self.parked())

    def crash_before_checkpoint(self, cursors: list[tuple[Any, ...]]) -> None:
        """As if the relay died after delivering and before its checkpoints: the cursors go back to
        ``cursors`` and the leases are free (the next relay takes over with a new fence)."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for bucket, snapshot, target, after_xid, after_seq in cursors:
                conn.execute("UPDATE outbox.cursors SET snapshot = %s::pg_snapshot, target = %s::pg_snapshot, "
                             "after_xid = %s::xid8, after_seq = %s, owner = NULL, lease_expires_at = NULL "
                             "WHERE sink = %s AND bucket = %s",
                             (snapshot, target, after_xid, after_seq, self.name(), bucket))

    # -- probes ---------------------------------------------------------------------------

    def _rows(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return list(conn.execute(query, params).fetchall())

    def cursors(self) -> list[tuple[Any, ...]]:
        return self._rows("SELECT bucket, snapshot::text, target::text, after_xid::text, after_seq "
                          "FROM outbox.cursors WHERE sink = %s", [self.name()])

    def undelivered(self) -> int:
        rows = self._rows("SELECT count(*) FROM outbox.events e JOIN outbox.cursors c ON c.sink = %s "
                          "AND c.bucket = e.bucket WHERE NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, "
                          "c.after_xid, c.after_seq)", [self.name()])
        known = self._rows("SELECT count(*) FROM outbox.cursors WHERE sink = %s", [self.name()])
        return int(rows[0][0]) if known[0][0] else -1  # -1: no cursors yet

    def parked(self) -> dict[uuid.UUID, tuple[int, str | None]]:
        rows = self._rows("SELECT event_id, attempts, last_error FROM outbox.parked WHERE sink = %s", [self.name()])
        return {r[0]: (r[1], r[2]) for r in rows}

    def parked_for(self, event_id: uuid.UUID) -> float:
        """Seconds until the parked event is due (as the database sees it)."""
        rows = self._rows("SELECT extract(epoch FROM available_at - clock_timestamp()) FROM outbox.parked "
                          "WHERE sink = %s AND event_id = %s", [self.name(), event_id])
        return float(rows[0][0]) if rows else 0.0

    def dead_letters(self) -> dict[uuid.UUID, tuple[int, str]]:
        rows = self._rows("SELECT event_id, attempts, last_error FROM outbox.dead_letters WHERE sink = %s",
                          [self.name()])
        return {r[0]: (r[1], r[2]) for r in rows}

    def delivered_ids(self) -> list[uuid.UUID]:
        return self.recorder.snapshot()

    def received_ids(self) -> list[uuid.UUID]:
        got = self.suite.received(self.sink)
        if got is None:
            return self.delivered_ids()
        self.custom_received = True
        return [i if isinstance(i, uuid.UUID) else uuid.UUID(str(i)) for i in got]

    def assert_in_order(self, published: dict[str, list[uuid.UUID]], without: Collection[uuid.UUID] = ()) -> None:
        """Per key, the received ids with repeats removed equal the published ones (minus ``without``)."""
        key_of = {i: key for key, ids in published.items() for i in ids}
        seen: set[uuid.UUID] = set()
        got: dict[str, list[uuid.UUID]] = defaultdict(list)
        for i in self.received_ids():
            if i in key_of and i not in seen:
                seen.add(i)
                got[key_of[i]].append(i)
        want = {key: [i for i in ids if i not in without] for key, ids in published.items()}
        want = {key: ids for key, ids in want.items() if ids}
        assert dict(got) == want, f"sink {self.name()}: per key, received (first time each) != published"
