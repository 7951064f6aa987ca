"""`outbox-relay replay` against a real broker and PostgreSQL: the right events, per key in publish
order, marked as a replay; the live Kafka sink's progress is untouched."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime
from typing import Any

import psycopg
import pytest

from outbox_relay import Outbox
from tests.integration.relay_helpers import fetch_all, register
from tests.servers import consume_all, create_topic

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


def main(args: list[str]) -> subprocess.CompletedProcess[str]:
    """The real `outbox-relay` command."""
    return subprocess.run([sys.executable, "-m", "outbox_relay.cli", *args], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def publish(dsn: str, topic: str, keys: list[str], per_key: int, start: int = 0) -> dict[str, list[str]]:
    """Publish per_key events for each key (one transaction per round); returns ids per key in order."""
    outbox = Outbox()
    out: dict[str, list[str]] = {}
    with psycopg.connect(dsn) as conn:
        for n in range(start, start + per_key):
            with conn.transaction():
                results = outbox.publish_many(conn, [
                    {"type": "t", "key": k, "topic": topic, "payload": {"n": n}} for k in keys])
            for k, r in zip(keys, results, strict=True):
                out.setdefault(k, []).append(str(r.id))
    return out


def by_key(messages: list[Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for m in sorted(messages, key=lambda m: (m.partition, m.offset)):
        out.setdefault(m.key, []).append(m.headers["ce_id"])
    return out


def test_replay_a_time_range_of_a_topic_and_one_key(dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    register(dsn, "kafka", "kafka")
    before = publish(dsn, "orders", ["a", "b", "c"], 2)
    time.sleep(0.05)
    start = datetime.now().astimezone()
    inside = publish(dsn, "orders", ["a", "b", "c"], 5, start=2)
    publish(dsn, "other-topic", ["a", "x"], 3)  # another topic: never replayed
    time.sleep(0.05)
    end = datetime.now().astimezone()
    publish(dsn, "orders", ["a"], 2, start=7)  # after the range
    cursors_before = fetch_all(dsn, "SELECT * FROM outbox.cursors ORDER BY bucket")

    common = ["replay", "--dsn", dsn, "--kafka-bootstrap-servers", kafka_bootstrap, "--topic", "orders",
              "--to-topic", kafka_topic]
    done = main([*common, "--from-time", start.isoformat(), "--to-time", end.isoformat()])
    assert done.returncode == 0 and "replayed 15 events" in done.stdout, done.stderr
    assert "15/15 events" in done.stderr, "the progress line"
    messages = consume_all(kafka_bootstrap, kafka_topic, 15, timeout=30, settle=1.0)
    assert by_key(messages) == inside, "exactly the range, per key in publish order"
    assert {m.headers["outbox_replay"] for m in messages} == {"true"}
    assert not set(before["a"]) & {m.headers["ce_id"] for m in messages}

    create_topic(kafka_bootstrap, kafka_topic + "-b", partitions=2)
    done = main(["replay", "--dsn", dsn, "--kafka-bootstrap-servers", kafka_bootstrap, "--topic", "orders",
                 "--to-topic", kafka_topic + "-b", "--key", "b"])
    assert done.returncode == 0 and "replayed 7 events" in done.stdout, done.stderr
    only_b = consume_all(kafka_bootstrap, kafka_topic + "-b", 7, timeout=30, settle=1.0)
    assert by_key(only_b) == {"b": before["b"] + inside["b"]}
    assert fetch_all(dsn, "SELECT * FROM outbox.cursors ORDER BY bucket") == cursors_before, \
        "a replay does not move the live sink"


def test_replay_events_without_topic_by_default_topic_and_bad_ranges(
        dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    register(dsn, "kafka", "kafka")
    with psycopg.connect(dsn, autocommit=True) as conn:  # a producer in another language, no topic
        ids = [conn.execute("INSERT INTO outbox.events (partition_key, type, payload) VALUES ('k', 't', %s) "
                            "RETURNING id::text", (f'{{"n": {n}}}',)).fetchone()[0] for n in range(3)]  # type: ignore[index]
    untopiced = {"k": ids}
    common = ["replay", "--dsn", dsn, "--kafka-bootstrap-servers", kafka_bootstrap, "--to-topic", kafka_topic]
    assert main([*common, "--topic", "orders", "--default-topic", "orders"]).returncode == 0
    assert by_key(consume_all(kafka_bootstrap, kafka_topic, 3, timeout=30, settle=0.5)) == untopiced
    bad = main([*common, "--topic", "orders", "--from-time", "2026-01-02T00:00:00+00:00",
                "--to-time", "2026-01-01T00:00:00+00:00"])
    assert bad.returncode == 2 and "--from-time must be before --to-time" in bad.stderr


def test_replay_exits_1_and_names_the_events_it_could_not_send(
        dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    """Exit code 1 (README, exit codes): the replay ran, sent what it could, and says which events
    failed and why; the others still go out in order."""
    register(dsn, "kafka", "kafka")
    outbox = Outbox()
    with psycopg.connect(dsn) as conn, conn.transaction():
        sent = outbox.publish_many(conn, [
            {"type": "t", "key": "k", "topic": "orders", "payload": {"n": 0}},
            {"type": "t", "key": "k", "topic": "orders", "payload": {"n": 1, "blob": "x" * 5000}},  # too large
            {"type": "t", "key": "k", "topic": "orders", "payload": {"n": 2}},
        ])
    too_large = str(sent[1].id)
    result = main(["replay", "--dsn", dsn, "--kafka-bootstrap-servers", kafka_bootstrap, "--topic", "orders",
                   "--to-topic", kafka_topic, "--kafka-option", "message.max.bytes=2000"])
    assert result.returncode == 1, result.stderr
    assert f"failed: {too_large}: kafka: MSG_SIZE_TOO_LARGE" in result.stderr, result.stderr
    assert "replayed 2 events; 1 failed" in result.stdout
    assert by_key(consume_all(kafka_bootstrap, kafka_topic, 2, timeout=30, settle=0.5)) == {
        "k": [str(sent[0].id), str(sent[2].id)]}


def test_replay_with_upcasters_sends_every_payload_in_its_current_shape(
        dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    """Version 1 of "t" had "n" as text; version 2 as a number. Replayed with the upcaster, a consumer
    sees version 2 only; an event the step can not handle is not sent and is named."""
    import json

    from outbox_relay.replay import replay
    from outbox_relay.settings import RelaySettings
    from outbox_relay.upcast import Upcasters

    ups = Upcasters()

    @ups.register("t", version=1)
    def text_to_number(payload: dict[str, Any]) -> dict[str, Any]:
        return {"n": int(payload["n"])}

    register(dsn, "kafka", "kafka")
    outbox = Outbox(default_topic="orders")
    with psycopg.connect(dsn) as conn:
        outbox.publish(conn, type="t", key="a", payload={"n": "1"})
        bad = outbox.publish(conn, type="t", key="b", payload={"n": "one"})
        outbox.publish(conn, type="t", key="a", payload={"n": 2}, version=2)
    settings = RelaySettings(dsn=dsn, worker_id="replayer", kafka_bootstrap_servers=kafka_bootstrap)
    result = replay(settings, "orders", to_topic=kafka_topic, progress=None, upcasters=ups)
    assert result.sent == 2
    assert [(event_id, "ValueError" in error) for event_id, error in result.failed] == [(bad.id, True)]
    messages = consume_all(kafka_bootstrap, kafka_topic, 2, timeout=30, settle=1.0)
    assert sorted(json.loads(m.value or b"")["n"] for m in messages) == [1, 2]
