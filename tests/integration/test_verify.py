"""``outbox-relay verify`` against a real PostgreSQL and a real Kafka-protocol broker: a relay's clean run
verifies (exit 0); a phantom, a lost event and two swapped events of a key are each detected (exit 1) and
named; duplicates, dead letters and events not yet delivered are not failures."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer
from psycopg_pool import ConnectionPool

from outbox_relay import store
from outbox_relay.publish import Outbox
from outbox_relay.sinks.engine import Failure
from outbox_relay.sinks.kafka import KafkaSink
from outbox_relay.testing import RecordingSink
from outbox_relay.verify import verify as verify_sink
from tests.cli_helpers import run_cli
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    make_settings,
    parked_ids,
    pool_fixture,
    run_until,
    runner_for,
    undelivered,
)
from tests.servers import Message, PgServer, consume_all, require_restartable

KAFKA = "kafka"


def produce(bootstrap: str, topic: str, messages: list[tuple[str, bytes, list[tuple[str, bytes]]]]) -> None:
    """(key, value, headers) in this order, each acknowledged (a test's own writes to the topic)."""
    producer = Producer({"bootstrap.servers": bootstrap, "partitioner": "murmur2_random", "log_level": 3})
    for key, value, headers in messages:
        producer.produce(topic, value=value, key=key.encode(), headers=headers)
        producer.flush(15)
    assert producer.flush(15) == 0


def copy_of(m: Message) -> tuple[str, bytes, list[tuple[str, bytes]]]:
    return (m.key or "", m.value or b"", [(k, (v or "").encode()) for k, v in m.headers.items()])


def verify(capsys: pytest.CaptureFixture[str], dsn: str, bootstrap: str, *args: str) -> tuple[int, str]:
    code, out, err = run_cli(capsys, "verify", "--sink", KAFKA, "--dsn", dsn, "--kafka-bootstrap-servers", bootstrap,
                             "--timeout-seconds", "5", *args)
    return code, out + err


@pytest.fixture
def kafka_sink(kafka_bootstrap: str) -> Iterator[KafkaSink]:
    sink = KafkaSink(KAFKA, {"bootstrap.servers": kafka_bootstrap}, None, "urn:outbox-relay:test")
    try:
        yield sink
    finally:
        sink.close()


def test_a_relays_run_to_kafka_verifies_and_a_phantom_fails_it(
        capsys: pytest.CaptureFixture[str], dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str,
        kafka_topic: str, kafka_sink: KafkaSink) -> None:
    outbox = Outbox(default_topic=kafka_topic)
    for n in range(4):  # four transactions of three keys
        with psycopg.connect(dsn) as conn:
            outbox.publish_many(conn, [{"key": k, "type": "t", "payload": {"n": n}} for k in ("a", "b", "c")])
    run_until(runner_for(kafka_sink, pool, make_settings(dsn, "relay-v")),
              lambda: undelivered(dsn, KAFKA) == 0 and not parked_ids(dsn, KAFKA), timeout=20)

    code, out = verify(capsys, dsn, kafka_bootstrap, "--json")
    report = json.loads(out[:out.rindex("}") + 1])
    assert code == 0, out
    assert report["ok"] and (report["stored"], report["delivered"], report["received"], report["lost"],
                             report["reordered"], report["phantoms"]) == (12, 12, 12, 0, 0, 0)

    # The library call, reading history one event per page: the same verdict (no page skips or repeats one).
    settings = make_settings(dsn, "verify", kafka_bootstrap_servers=kafka_bootstrap)
    with psycopg.connect(dsn, autocommit=True) as conn:
        paged = verify_sink(conn, KAFKA, settings, page=1)
    assert paged.ok and (paged.stored, paged.delivered, paged.received) == (12, 12, 12)

    # A copy of a delivered message (at-least-once) is counted, not a failure.
    messages = consume_all(kafka_bootstrap, kafka_topic, 12, timeout=20)
    produce(kafka_bootstrap, kafka_topic, [copy_of(messages[0])])
    code, out = verify(capsys, dsn, kafka_bootstrap)
    assert code == 0 and "OK: lost 0, reordered 0, phantoms 0" in out and "(1 duplicates, allowed)" in out, out

    # A message whose event id was never stored: a phantom, named (its key escaped for the terminal).
    ghost = uuid.uuid4()
    produce(kafka_bootstrap, kafka_topic, [("evil\x1b[31m", b"{}", [("ce_id", str(ghost).encode())])])
    code, out = verify(capsys, dsn, kafka_bootstrap)
    assert code == 1, out
    assert "FAILED: lost 0, reordered 0, phantoms 1" in out and str(ghost) in out
    assert "evil\\x1b[31m" in out and "\x1b" not in out


def test_a_lost_event_and_two_swapped_events_of_a_key_are_named(
        capsys: pytest.CaptureFixture[str], dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str,
        kafka_topic: str) -> None:
    outbox = Outbox(default_topic=kafka_topic)
    published: dict[str, uuid.UUID] = {}
    for name, key in (("x1", "x"), ("y1", "y"), ("x2", "x"), ("z1", "z")):  # one transaction each
        with psycopg.connect(dsn) as conn:
            published[name] = outbox.publish(conn, type="t", key=key, payload={"e": name}).id
    # A broken sink: it acknowledges without writing to the broker (and dead-letters z1, non-retriably).
    broken = RecordingSink(KAFKA, fail=lambda e, _n: Failure("no", retriable=False) if e.key == "z" else None)
    run_until(runner_for(broken, pool, make_settings(dsn, "relay-v")),
              lambda: undelivered(dsn, KAFKA) == 0 and not parked_ids(dsn, KAFKA), timeout=20)
    with psycopg.connect(dsn) as conn:  # past the cursor: not yet delivered
        later = outbox.publish(conn, type="t", key="w", payload={}).id

    def message(name: str, key: str) -> tuple[str, bytes, list[tuple[str, bytes]]]:
        return key, b"{}", [("ce_id", str(published[name]).encode())]

    # What reached the topic: x's two events swapped, y1 never.
    produce(kafka_bootstrap, kafka_topic, [message("x2", "x"), message("x1", "x")])
    code, out = verify(capsys, dsn, kafka_bootstrap)
    assert code == 1, out
    assert "stored: 5 events of its topics: 3 delivered, 1 not yet delivered, 1 dead-lettered" in out, out
    assert "FAILED: lost 1, reordered 1, phantoms 0" in out
    lost = out[out.index("lost, by key"):out.index("reordered, by key")]
    assert "y" in lost and str(published["y1"]) in lost
    reordered = out[out.index("reordered, by key"):]
    assert str(published["x2"]) in reordered and str(published["x1"]) in reordered
    assert reordered.index(str(published["x2"])) < reordered.index(str(published["x1"])), "came first, then after"
    assert str(later) not in out
    with psycopg.connect(dsn) as conn:
        commit_times = (conn.execute("SHOW track_commit_timestamp").fetchone() or ("",))[0] == "on"
    assert commit_times or "track_commit_timestamp = off" in out, "the report says why any inversion counts"

    code, out = verify(capsys, dsn, kafka_bootstrap, "--json")
    report = json.loads(out[:out.rindex("}") + 1])
    assert code == 1 and not report["ok"]
    assert report["lost_keys"] == [{"key": "y", "event_ids": [str(published["y1"])], "count": 1}]
    assert [(k["key"], k["came_first"], k["came_after"]) for k in report["reordered_keys"]] == [
        ("x", str(published["x2"]), str(published["x1"]))]


def test_a_projection_is_checked_by_its_checkpoint(
        capsys: pytest.CaptureFixture[str], dsn: str, pool: ConnectionPool[Any]) -> None:
    with psycopg.connect(dsn) as conn:
        Outbox().publish(conn, type="t", key="k", topic="orders", payload={})
    projection = RecordingSink("totals", kind="projection")
    run_until(runner_for(projection, pool, make_settings(dsn, "relay-v")), lambda: undelivered(dsn, "totals") == 0)
    code, out, _ = run_cli(capsys, "verify", "--sink", "totals", "--dsn", dsn)
    assert code == 0 and "can not be read back" in out and "1 delivered" in out, out


def test_sinks_verify_can_not_read_are_refused_with_the_reason(capsys: pytest.CaptureFixture[str], dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.register_sink(conn, "rabbit", "rabbitmq")
        store.register_sink(conn, "audit", "audit")
    code, _, err = run_cli(capsys, "verify", "--sink", "rabbit", "--dsn", dsn)  # a broker it can not reach
    assert code == 2 and "no RabbitMQ URL: pass --rabbitmq-url or set OUTBOX_RABBITMQ_URL" in err, err
    code, _, err = run_cli(capsys, "verify", "--sink", "audit", "--dsn", dsn)
    assert code == 2 and "of kind 'audit'" in err, err
    code, _, err = run_cli(capsys, "verify", "--sink", "nope", "--dsn", dsn)
    assert code == 2 and "no sink named 'nope'" in err, err


def test_events_delivered_while_the_sink_is_read_back_are_neither_lost_nor_phantoms(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The history is read in a snapshot taken before the read-back: an event delivered after the reader
    passed is not expected yet, and one the reader saw that the snapshot does not hold is found again."""
    from outbox_relay.verify import run as verify_run

    outbox = Outbox(default_topic=kafka_topic)
    runner = runner_for(kafka_sink, pool, make_settings(dsn, "relay-v"))

    def deliver_one(key: str) -> uuid.UUID:
        with psycopg.connect(dsn) as conn:
            event_id = outbox.publish(conn, type="t", key=key, payload={}).id
        run_until(runner, lambda: undelivered(dsn, KAFKA) == 0, timeout=20)
        return event_id

    deliver_one("a")
    real = verify_run.read_back

    def live(*args: Any, **kwargs: Any) -> Any:
        deliver_one("seen")  # committed after the snapshot, read back
        got = real(*args, **kwargs)
        deliver_one("unseen")  # delivered after the reader passed
        return got

    monkeypatch.setattr(verify_run, "read_back", live)
    settings = make_settings(dsn, "verify", kafka_bootstrap_servers=kafka_bootstrap)
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = verify_sink(conn, KAFKA, settings)
    assert report.ok, report
    assert (report.stored, report.delivered, report.received, report.pending) == (1, 1, 2, 1)


@pytest.fixture
def commit_times(pg_server: PgServer) -> Iterator[None]:
    """The session's server recording commit times (track_commit_timestamp needs a restart)."""
    require_restartable(pg_server)

    def set_to(value: str | None) -> None:
        with pg_server.admin() as conn:
            conn.execute("ALTER SYSTEM RESET track_commit_timestamp" if value is None
                         else "ALTER SYSTEM SET track_commit_timestamp = on")
        pg_server.restart()

    set_to("on")
    try:
        yield
    finally:
        set_to(None)


def test_two_overlapping_transactions_of_a_key_may_come_in_either_order_when_commit_times_tell(
        commit_times: None, dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str,
        kafka_sink: KafkaSink) -> None:
    """The relay delivers a key's later transaction first when the earlier one was still open (G6, "The
    order one key gets"): with commit times verify knows they overlapped, and allows it."""
    outbox = Outbox(default_topic=kafka_topic)
    runner = runner_for(kafka_sink, pool, make_settings(dsn, "relay-v"))
    with psycopg.connect(dsn) as first:
        earlier = outbox.publish(first, type="t", key="k", payload={"n": 1}).id  # takes the smaller xid, stays open
        with psycopg.connect(dsn) as second:
            later = outbox.publish(second, type="t", key="k", payload={"n": 2}).id
        run_until(runner, lambda: undelivered(dsn, KAFKA) == 0, timeout=20)  # the later one goes first
    run_until(runner, lambda: undelivered(dsn, KAFKA) == 0, timeout=20)
    order = [m.headers["ce_id"] for m in consume_all(kafka_bootstrap, kafka_topic, 2, timeout=20)]
    assert order == [str(later), str(earlier)]

    settings = make_settings(dsn, "verify", kafka_bootstrap_servers=kafka_bootstrap)
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = verify_sink(conn, KAFKA, settings)
    assert report.ok and (report.delivered, report.reordered, report.overlapping) == (2, 0, 1), report


def test_a_broker_sink_is_read_back_by_its_kinds_readback_module(
        capsys: pytest.CaptureFixture[str], dsn: str, pool: ConnectionPool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contract with each broker sink's reader (outbox_relay/sinks/<kind>/readback.py): called with the
    relay's settings and the topics to read, it returns (event id, key, destination) in the broker's order."""
    import types

    with psycopg.connect(dsn) as conn:
        a, b, c = (Outbox().publish(conn, type="t", key="k", topic=t, payload={}).id
                   for t in ("orders", "refunds", "orders"))
    sink = RecordingSink("rabbit")
    sink.kind = "nats"  # registered as a NATS sink, whose cursor moves past the three
    run_until(runner_for(sink, pool, make_settings(dsn, "relay-v")), lambda: undelivered(dsn, "rabbit") == 0)
    calls: list[tuple[Any, Any, Any]] = []

    def read_back(fields: Any, *, topics: Any = None, timeout_seconds: float = 5.0) -> list[Any]:
        calls.append((fields.dsn.get_secret_value(), sorted(topics), timeout_seconds))
        return [(b, "k", "refunds"), (a, "k", "orders"), (a, "k", "orders")]  # c never arrived

    module = types.ModuleType("outbox_relay.sinks.nats.readback")
    module.read_back = read_back  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    code, out, _ = run_cli(capsys, "verify", "--sink", "rabbit", "--dsn", dsn, "--timeout-seconds", "2")
    assert code == 1 and "FAILED: lost 1, reordered 0, phantoms 0" in out and str(c) in out, out
    assert "(1 duplicates, allowed)" in out
    assert calls == [(dsn, ["orders", "refunds"], 2.0)]
