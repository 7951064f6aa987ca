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

import contextlib
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from ..migrate import migrate
from ..sinks import check_sink
from ..sinks.engine import is_engine_sink
from .sink_faults import GIVE_UP, HANG, RAISE, RETRY, UNAVAILABLE
from .sink_harness import Harness, fresh_database, server_dsn

__all__ = ["SinkContract"]


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
            with fresh_database(server_dsn()) as fresh:
                migrate(fresh)
                yield fresh
            return
        migrate(dsn)
        yield dsn

    @pytest.fixture(name="contract")
    def _contract(self, contract_dsn: str) -> Iterator[Harness]:
        self.prepare_database(contract_dsn)
        harness = Harness(self, contract_dsn)
        try:
            yield harness
        finally:
            harness.close()

    # -- the tests ----------------------------------------------------------------------------

    def test_sink_keeps_the_contract_shape(self, contract: Harness) -> None:
        sink = contract.sink
        if is_engine_sink(sink):
            assert isinstance(sink.name, str) and isinstance(sink.kind, str) and callable(sink.close)
        else:
            check_sink(sink)

    def test_every_event_arrives_in_order_per_key(self, contract: Harness) -> None:
        published = contract.publish(keys=5, per_key=6, transactions=3)
        runner = contract.runner()
        contract.run_until_settled(runner)
        assert contract.dead_letters() == {}
        contract.assert_in_order(published)

    def test_order_holds_under_failures(self, contract: Harness) -> None:
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

    def test_retry_parks_its_key_and_comes_again(self, contract: Harness) -> None:
        first, second = contract.publish(keys=1, per_key=2)["k0"]
        contract.plan.set(first, RETRY)
        runner = contract.runner()
        contract.run_until(runner, lambda: contract.parked().get(first, (0, None))[0] == 1)
        # The park as stored (the seconds left by now would depend on how fast this loop ran); parked_at is
        # read a moment after the due time is computed, in the same statement: hence 0.29.
        assert contract.park_seconds(first) >= 0.29, "Retry(after_seconds=0.3) is a floor on the park"
        assert second not in contract.delivered_ids(), "the key waits behind its retry"
        contract.run_until_settled(runner)
        contract.assert_in_order({"k0": [first, second]})

    def test_give_up_dead_letters_at_once_and_the_key_goes_on(self, contract: Harness) -> None:
        first, second = contract.publish(keys=1, per_key=2)["k0"]
        contract.plan.set(first, GIVE_UP)
        contract.run_until_settled(contract.runner(max_attempts=5))
        dead = contract.dead_letters()
        assert list(dead) == [first] and dead[first][0] == 1 and "give-up" in dead[first][1]
        contract.assert_in_order({"k0": [second]})

    def test_unavailable_holds_without_counting_attempts(self, contract: Harness) -> None:
        ids = contract.publish(keys=2, per_key=2)
        head = ids["k0"][0]
        contract.plan.set(head, UNAVAILABLE, UNAVAILABLE, UNAVAILABLE)  # more outages than max_attempts
        contract.run_until_settled(contract.runner(max_attempts=2))
        assert contract.dead_letters() == {}
        contract.assert_in_order(ids)

    def test_an_exception_is_a_retry(self, contract: Harness) -> None:
        if contract.engine:
            pytest.skip("an engine sink's exception fails its batch as a whole (the engine then isolates the "
                        "event); per-event exceptions are the EventSink adapter's rule")
        first, second = contract.publish(keys=1, per_key=2)["k0"]
        contract.plan.set(first, RAISE, RAISE)
        contract.run_until_settled(contract.runner(max_attempts=5))
        assert contract.dead_letters() == {}
        contract.assert_in_order({"k0": [first, second]})

    def test_a_call_past_the_time_limit_is_abandoned_and_the_other_keys_go_on(self, contract: Harness) -> None:
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

    def test_redelivery_after_a_crash_is_taken(self, contract: Harness) -> None:
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

    def test_downstream_down_then_back(self, contract: Harness) -> None:
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

    def test_downstream_rejects_dead_letter_with_a_reason(self, contract: Harness) -> None:
        contract.publish(keys=1, per_key=2)
        runner = contract.runner(max_attempts=3)
        with self.break_downstream(contract.sink, "rejects"):
            contract.run_until(runner, lambda: len(contract.dead_letters()) == 2)
        assert all(error for _, error in contract.dead_letters().values())

    def test_downstream_hangs_then_recovers(self, contract: Harness) -> None:
        ids = contract.publish(keys=2, per_key=2)
        runner = contract.runner(max_attempts=100, handler_timeout_seconds=self.handler_timeout_seconds)
        with self.break_downstream(contract.sink, "hangs"):
            contract.run_until(runner, lambda: any(n >= 1 for n, _ in contract.parked().values()))
        contract.run_until_settled(runner)
        assert contract.dead_letters() == {}
        contract.assert_in_order(ids)

