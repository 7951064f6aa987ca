"""The inbox consumer's /metrics, /healthz and /readyz (``--metrics-port``), against a real broker and
PostgreSQL (docs/observability.md lists the metrics)."""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from outbox_relay.inbox import InboxConsumer, InboxMessage
from tests.integration import inbox_app
from tests.integration.inbox_helpers import consumer_thread, inbox_database, produce_events, settings
from tests.integration.test_metrics import probe, scrape, value
from tests.servers import free_port, wait_until

OBSERVABILITY = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


def raw_scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def doc_problems(text: str) -> list[str]:
    """docs/observability.md has a row for every metric family the consumer serves, and names no other."""
    doc = OBSERVABILITY.read_text()
    families = {f.name + ("_total" if f.type == "counter" else "") for f in text_string_to_metric_families(text)
                if not f.name.endswith("_created")}
    rows = set(re.findall(r"^\| `(outbox_inbox_\w+)` \|", doc, re.MULTILINE))
    named = set(re.findall(r"\b(outbox_inbox_\w+)", doc))
    return [f"{n}: no row" for n in sorted(families - rows)] + [f"{n}: not served" for n in sorted(named - families)]


@pytest.fixture
def inbox_dsn(database_factory: Callable[..., str]) -> str:
    return inbox_database(database_factory)


def test_a_scrape_shows_what_the_consumer_did_its_lag_and_the_probes_say_it_is_ready(
        inbox_dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    ids = produce_events(kafka_bootstrap, kafka_topic, [("k", 0, {"n": i}) for i in range(20)])
    produce_events(kafka_bootstrap, kafka_topic, [("k", 0, {"n": i}) for i in range(3)], ids=ids[:3])  # redelivery
    entered, release = threading.Event(), threading.Event()

    def held_at_first(message: InboxMessage, conn: psycopg.Connection[Any]) -> None:
        if message.offset == 0 and message.partition == 0:
            entered.set()
            release.wait(30)  # the partition's other 22 messages were fetched with it
        inbox_app.handle(message, conn)

    port = free_port()
    s = settings(inbox_dsn, kafka_bootstrap, kafka_topic, metrics_port=port, metrics_host="127.0.0.1",
                 max_attempts=2)
    with consumer_thread(s, held_at_first) as consumer:
        assert entered.wait(30)
        assert consumer.metrics_port == port
        lag = value(scrape(port), "outbox_inbox_lag_messages", consumer="inbox", topic=kafka_topic, partition="0")
        assert lag is not None and lag >= 1, "messages fetched, none applied yet"
        time.sleep(0.3)  # the held call shows in the histogram's upper buckets
        release.set()
        wait_until(lambda: consumer.stats.applied == 20 and consumer.stats.duplicates == 3, 30, 0.1)
        produce_events(kafka_bootstrap, kafka_topic, [("p", 1, {"poison": True})])
        wait_until(lambda: consumer.stats.dead == 1, 30, 0.1)

        def caught_up() -> bool:
            samples = scrape(port)
            return all(value(samples, "outbox_inbox_lag_messages", consumer="inbox", topic=kafka_topic,
                             partition=str(p)) == 0 for p in range(4))
        wait_until(caught_up, 15, 0.2, "no lag once everything is applied")
        samples = scrape(port)
        assert value(samples, "outbox_inbox_applied_total", consumer="inbox") == 20
        assert value(samples, "outbox_inbox_duplicates_total", consumer="inbox") == 3
        assert value(samples, "outbox_inbox_dead_lettered_total", consumer="inbox") == 1
        assert value(samples, "outbox_inbox_retries_total", consumer="inbox") == 1
        assert value(samples, "outbox_inbox_partitions_lapsed_total", consumer="inbox") == 0
        assert value(samples, "outbox_inbox_partitions_held", consumer="inbox") == 4
        assert value(samples, "outbox_inbox_partitions_share", consumer="inbox") == 4
        assert value(samples, "outbox_inbox_position", consumer="inbox", topic=kafka_topic, partition="0") == 23
        assert value(samples, "outbox_inbox_position", consumer="inbox", topic=kafka_topic, partition="1") == 1
        assert value(samples, "outbox_inbox_head_attempts", consumer="inbox", topic=kafka_topic, partition="1") == 0
        # The handler ran for the 20 applied and twice for the poison message (duplicates skip it).
        calls = value(samples, "outbox_inbox_handler_duration_seconds_count", consumer="inbox", topic=kafka_topic)
        assert calls is not None and calls >= 22
        slow = value(samples, "outbox_inbox_handler_duration_seconds_bucket", consumer="inbox", topic=kafka_topic,
                     le="0.1")
        assert slow is not None and slow <= calls - 1, "the held call took longer than 0.1 s"
        assert value(samples, "outbox_inbox_ready", consumer="inbox") == 1
        assert probe(port, "/healthz") == (200, {"ok": True, "problems": []})
        assert probe(port, "/readyz") == (200, {"ok": True, "problems": []})
        assert doc_problems(raw_scrape(port)) == []
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # closed with the consumer


def test_a_consumer_is_not_ready_before_its_first_round_nor_while_it_stops(
        inbox_dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    consumer = InboxConsumer(settings(inbox_dsn, kafka_bootstrap, kafka_topic), inbox_app.handle)
    assert consumer.health() == ["not registered yet (waiting for the database and the broker)"]
    consumer.start()
    try:
        assert consumer.metrics_port is None, "no port unless asked"
        consumer.run_once()
        assert consumer.health() == [] and consumer.readiness() == []
    finally:
        consumer.close()
    assert "stopping" in consumer.readiness()


def test_a_metrics_port_in_use_is_a_clear_error_and_nothing_is_left_open(
        inbox_dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    from outbox_relay.errors import ConfigurationError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        consumer = InboxConsumer(settings(inbox_dsn, kafka_bootstrap, kafka_topic, metrics_port=port,
                                          metrics_host="127.0.0.1"), inbox_app.handle)
        with pytest.raises(ConfigurationError, match=rf"cannot serve metrics on 127.0.0.1:{port} \(--metrics-port"):
            consumer.run(threading.Event())
    assert consumer._control is not None and consumer._control.closed
    assert consumer._db is not None and consumer._db.closed
