"""The projection batch walk (projections/walk.py) without a database: the steps it asks for and what it
makes of the replies. The integration tests run it on real connections (test_projections.py,
test_batched_projections.py, test_testing_kit.py); these pin its decisions one by one."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from psycopg import pq

from outbox_relay.errors import NonRetriableDelivery
from outbox_relay.store import StoredEvent
from projections import projection
from projections.walk import SWALLOWED_ERROR, Batch, Call, Execute, Redo, Reply, Walk, walk

OK = Reply(None, pq.TransactionStatus.INTRANS)


def stored(key: str, n: int, type_: str = "A") -> StoredEvent:
    return StoredEvent(bucket=1, xid=10, seq=n, id=uuid.uuid4(), key=key, topic="t", type=type_,
                       payload_text=f'{{"n": {n}}}', headers_text="{}", time=datetime.now(UTC))


def declared(batch: bool) -> Any:
    return projection("p", events=["A"], batch=batch)(lambda e, tx: None)


def run(steps: Walk, replies: dict[int, Reply] | None = None) -> tuple[list[Any], Any]:
    """Drive a walk, answering each step with OK or the reply given for its call number (1-based)."""
    seen: list[Any] = []
    calls = 0
    reply: Reply | None = None
    try:
        while True:
            step = steps.send(reply) if reply is not None else next(steps)
            seen.append(step)
            reply = OK
            if isinstance(step, Call):
                calls += 1
                reply = (replies or {}).get(calls, OK)
    except StopIteration as done:
        return seen, done.value


def test_the_fast_walk_gives_a_batched_handler_the_whole_batch_in_one_call() -> None:
    events = [stored("a", 1), stored("b", 2), stored("a", 3)]
    batch = Batch(declared(True), events, {1: 7})
    steps, outcomes = run(walk(batch, careful=False, begin={"idle_ms": "1", "shadow": None}))
    assert [type(s) for s in steps] == [Execute, Call, Execute]  # begin_batch, the call, end_batch
    call = steps[1]
    assert isinstance(call, Call) and call.batch and [e.payload["n"] for e in call.argument] == [1, 2, 3]
    assert call.event is None, "a hang of a call with several events is not pinned on one"
    assert outcomes == {e.id: None for e in events}
    assert [e.token.fence for e in batch.applied] == [7, 7, 7]


def test_a_failing_batch_call_is_not_pinned_on_any_event() -> None:
    batch = Batch(declared(True), [stored("a", 1), stored("b", 2)], {1: 1})
    with pytest.raises(Redo) as redo:
        run(walk(batch, careful=False), {1: Reply(ValueError("x"), pq.TransactionStatus.INTRANS)})
    assert redo.value.failed == {} and redo.value.ended is None


def test_the_careful_walk_calls_one_event_at_a_time_and_charges_only_the_failing_one() -> None:
    events = [stored("a", 1), stored("a", 2), stored("b", 3), stored("c", 4)]
    batch = Batch(declared(True), events, {1: 1}, known={})
    failed = Reply(ValueError("poison"), pq.TransactionStatus.INERROR)
    steps, outcomes = run(walk(batch, careful=True, end=False), {1: failed, 2: Reply(NonRetriableDelivery("no"),
                                                                                        pq.TransactionStatus.INTRANS)})
    calls = [s for s in steps if isinstance(s, Call)]
    assert [len(c.stored) for c in calls] == [1, 1, 1], "one event per call; a's second waits behind its first"
    assert all(c.batch and isinstance(c.argument, list) for c in calls), "a batched handler still gets a list"
    assert outcomes[events[0].id] is not None and outcomes[events[0].id].retriable
    assert events[1].id not in outcomes and batch.waiting == 1
    assert outcomes[events[2].id] is not None and not outcomes[events[2].id].retriable
    assert outcomes[events[3].id] is None
    assert [e.id for e in batch.applied] == [events[3].id]


def test_a_per_event_handler_that_swallowed_a_failed_statement_is_charged() -> None:
    events = [stored("a", 1)]
    batch = Batch(declared(False), events, {1: 1}, known={})
    _, outcomes = run(walk(batch, careful=True, end=False), {1: Reply(None, pq.TransactionStatus.INERROR)})
    assert outcomes == {events[0].id: SWALLOWED_ERROR}


def test_a_handler_that_ended_the_transaction_is_pinned_for_the_redo() -> None:
    events = [stored("a", 1), stored("b", 2)]
    batch = Batch(declared(False), events, {1: 1})
    with pytest.raises(Redo) as redo:
        run(walk(batch, careful=False), {1: Reply(None, pq.TransactionStatus.IDLE)})
    assert redo.value.ended == events[0].id and events[0].id in redo.value.failed
