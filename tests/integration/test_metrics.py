"""/metrics, /healthz and /readyz of a real relay delivering to a real broker, read by real scrapes."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.sql
import pytest
from prometheus_client.parser import text_string_to_metric_families

from outbox_relay import Outbox
from outbox_relay.compose import build_worker
from outbox_relay.settings import RelaySettings
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import dead_letters, make_settings, publish, running
from tests.servers import KafkaServer, free_port, require_restartable, wait_until


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def probe(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def relay(dsn: str, kafka_bootstrap: str, kafka_topic: str) -> Iterator[tuple[Worker, int]]:
    port = free_port()
    settings = RelaySettings(dsn=dsn, worker_id="metered", kafka_bootstrap_servers=kafka_bootstrap,
                             default_topic=kafka_topic, metrics_port=port, metrics_host="127.0.0.1",
                             metrics_refresh_seconds=1, heartbeat_seconds=0.2, worker_ttl_seconds=2,
                             housekeeping_seconds=0.5, lease_seconds=5, listen=True, kafka_stall_seconds=5)
    with running(build_worker(settings)) as worker:
        yield worker, port


def test_a_scrape_shows_what_the_relay_did_and_the_probes_say_it_is_ready(
        dsn: str, kafka_topic: str, relay: tuple[Worker, int]) -> None:
    worker, port = relay
    wait_until(lambda: probe(port, "/readyz")[0] == 200, 20, message="the relay to be ready")
    assert probe(port, "/healthz") == (200, {"ok": True, "problems": []})
    outbox = Outbox(default_topic=kafka_topic)
    with psycopg.connect(dsn) as conn:
        outbox.publish_many(conn, [{"type": "t", "key": f"k{i % 7}", "payload": {"i": i}} for i in range(40)])
        outbox.publish(conn, type="t", key="huge", payload={"blob": "x" * 2_000_000})  # over the broker's limit

    def counted() -> Any:
        s = scrape(port)
        return (value(s, "outbox_relay_events_delivered_total", sink="kafka") == 40
                and value(s, "outbox_relay_events_dead_lettered_total", sink="kafka") == 1) and s

    samples = wait_until(counted, 20, message="the counters to show 40 delivered and 1 dead letter")
    assert value(samples, "outbox_relay_delivery_latency_seconds_count", sink="kafka") == 40
    assert value(samples, "outbox_relay_buckets_held", sink="kafka") == 256
    assert value(samples, "outbox_relay_buckets_assigned", sink="kafka") == 256
    assert value(samples, "outbox_relay_lease_changes_total", sink="kafka", change="acquired") == 256
    assert value(samples, "outbox_relay_listening") == 1.0
    assert len(dead_letters(dsn, "kafka")) == 1

    # The outbox-wide gauges come from the background refresh: nothing pending, one dead letter.
    def refreshed() -> Any:
        s = scrape(port)
        return (value(s, "outbox_relay_dead_letters", sink="kafka") == 1
                and value(s, "outbox_relay_pending_events", sink="kafka") == 0) and s

    samples = wait_until(refreshed, 10, message="the outbox gauges to be refreshed")
    assert value(samples, "outbox_relay_oldest_pending_age_seconds", sink="kafka") == 0
    assert value(samples, "outbox_relay_housekeeping_last_finished_age_seconds") is not None
    assert wait_until(lambda: value(scrape(port), "outbox_relay_housekeeping_runs_total") or 0, 10) >= 1

    worker.drain()
    status, body = probe(port, "/readyz")
    assert status == 503 and "draining" in body["problems"]


def test_readiness_waits_for_buckets_another_relay_still_holds(dsn: str, kafka_bootstrap: str,
                                                              kafka_topic: str) -> None:
    """/readyz answers 503 while buckets assigned to the relay are still leased by a relay that does not
    let go (alive, not releasing), and 200 once that relay is gone and its leases are taken back."""
    from outbox_relay import store

    stop = threading.Event()
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.register_sink(conn, "kafka", "kafka")
        store.heartbeat(conn, "ghost", "alive", ["kafka"], {}, ttl=2.0)
        assert len(store.acquire_leases(conn, "kafka", "ghost", range(256), 600.0)) == 256

    def beat() -> None:  # alive, but never releases what is no longer assigned to it
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.wait(0.2):
                store.heartbeat(conn, "ghost", "alive", ["kafka"], {}, ttl=2.0)

    beating = threading.Thread(target=beat)
    beating.start()
    port = free_port()
    worker = build_worker(RelaySettings(
        dsn=dsn, worker_id="metered", kafka_bootstrap_servers=kafka_bootstrap, default_topic=kafka_topic,
        metrics_port=port, metrics_host="127.0.0.1", heartbeat_seconds=0.2, worker_ttl_seconds=2,
        housekeeping_seconds=0.5, lease_seconds=5))
    try:
        with running(worker):
            def waiting() -> Any:
                reply = _try_probe(port, "/readyz")
                return reply is not None and reply[0] == 503 and any(
                    "buckets not leased yet" in p for p in reply[1]["problems"]) and reply[1]

            body = wait_until(waiting, 20, message="/readyz to say which buckets it waits for")
            [problem] = [p for p in body["problems"] if "not leased yet" in p]
            assert re.fullmatch(r"sink kafka: (\d+) of its \1 buckets not leased yet", problem), problem
            stop.set()  # the ghost stops heartbeating: housekeeping declares it dead and frees its leases
            beating.join(10)
            wait_until(lambda: probe(port, "/readyz")[0] == 200, 30, message="/readyz once the buckets are leased")
            assert value(scrape(port), "outbox_relay_buckets_held", sink="kafka") == 256
    finally:
        stop.set()
        beating.join(10)


def test_the_keys_that_lag_are_named(dsn: str, kafka_topic: str, relay: tuple[Worker, int]) -> None:
    """A second sink that no relay runs lags on every key: the top keys show up with their counts."""
    _, port = relay
    with psycopg.connect(dsn, autocommit=True) as conn:
        from outbox_relay import store

        store.register_sink(conn, "stalled", "projection")
    outbox = Outbox(default_topic=kafka_topic)
    with psycopg.connect(dsn) as conn:
        outbox.publish_many(conn, [{"type": "t", "key": "hot", "payload": {}} for _ in range(30)]
                            + [{"type": "t", "key": f"cold-{i}", "payload": {}} for i in range(3)])

    def lagging() -> Any:
        s = scrape(port)
        return value(s, "outbox_relay_key_pending_events", sink="stalled", key="hot") == 30 and s

    samples = wait_until(lagging, 15, message="the hot key's lag to show")
    assert value(samples, "outbox_relay_pending_events", sink="stalled") == 33
    assert (value(samples, "outbox_relay_key_oldest_pending_age_seconds", sink="stalled", key="hot") or 0) >= 0
    # Kafka keeps up; its stored cursor (what the gauges read) trails by up to --cursor-flush-seconds.
    wait_until(lambda: value(scrape(port), "outbox_relay_key_pending_events", sink="kafka", key="hot") is None, 15,
               message="kafka's lag to clear")


def test_history_per_retention_class_and_what_holds_it(dsn: str, kafka_topic: str,
                                                       relay: tuple[Worker, int]) -> None:
    """0014: partitions, bytes and the oldest event per retention class; blocked while a sink that no
    relay runs holds the oldest partition past its retention (the relays keep 7 days: the class 'now'
    keeps 0 s)."""
    _, port = relay
    with psycopg.connect(dsn, autocommit=True) as conn:
        from outbox_relay import history, store

        history.set_class(conn, "now", 0.0)
        history.map_topic(conn, kafka_topic, "now")
        history.roll(conn, 86400.0, min_width=1000)
        store.register_sink(conn, "stalled", "projection")
    with psycopg.connect(dsn) as conn:
        Outbox(default_topic=kafka_topic).publish_many(conn, [{"type": "t", "key": "k", "payload": {}}])
    with psycopg.connect(dsn, autocommit=True) as conn:
        history.roll(conn, 86400.0, min_width=1000)

    def blocked() -> Any:
        s = scrape(port)
        return value(s, "outbox_relay_history_retention_blocked", **{"class": "now"}) == 1.0 and s

    samples = wait_until(blocked, 15, message="the stalled sink to hold retention of class 'now'")
    assert (value(samples, "outbox_relay_history_partitions", **{"class": "now"}) or 0) >= 1
    assert (value(samples, "outbox_relay_history_bytes", **{"class": "now"}) or 0) > 0
    assert (value(samples, "outbox_relay_history_oldest_event_age_seconds", **{"class": "now"}) or -1) >= 0
    assert value(samples, "outbox_relay_history_retention_blocked", **{"class": "default"}) == 0.0


def test_a_paused_key_s_events_are_counted_apart_from_retrying_ones(dsn: str, relay: tuple[Worker, int]) -> None:
    """Events held by a paused key wait for an operator, not for a retry: their own gauge, not parked."""
    _, port = relay
    with psycopg.connect(dsn, autocommit=True) as conn:
        from outbox_relay import store

        store.register_sink(conn, "held", "projection")
    with psycopg.connect(dsn) as conn:
        Outbox(default_topic="t").publish_many(conn, [{"type": "t", "key": k, "payload": {}}
                                                      for k in ("paused", "paused", "retrying")])
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox.paused_keys (sink, partition_key, paused_by) VALUES ('held', 'paused', 't')")
        conn.execute("INSERT INTO outbox.parked (sink, bucket, xid, seq, partition_key, event_id) "
                     "SELECT 'held', bucket, xid, seq, partition_key, id FROM outbox.events "
                     "WHERE partition_key IN ('paused', 'retrying')")

    def counted() -> Any:
        s = scrape(port)
        return value(s, "outbox_relay_paused_events", sink="held") == 2 and s

    samples = wait_until(counted, 15, message="the paused key's events to show")
    assert value(samples, "outbox_relay_parked_events", sink="held") == 1
    assert value(samples, "outbox_relay_paused_keys", sink="held") == 1


def test_readiness_follows_the_broker(kafka_server: KafkaServer, relay: tuple[Worker, int]) -> None:
    require_restartable(kafka_server)
    _, port = relay
    wait_until(lambda: probe(port, "/readyz")[0] == 200, 20, message="the relay to be ready")
    kafka_server.stop()
    try:
        _, body = wait_until(lambda: (r := probe(port, "/readyz"))[0] == 503 and r, 20,
                             message="/readyz to notice the broker is gone")
        assert any("Kafka brokers do not answer" in p for p in body["problems"]), body
        assert probe(port, "/healthz")[0] == 200, "the relay itself is fine"
    finally:
        kafka_server.start()
    wait_until(lambda: probe(port, "/readyz")[0] == 200, 30, message="/readyz once the broker is back")


def test_the_health_endpoint_answers_while_the_database_is_away(kafka_bootstrap: str) -> None:
    port = free_port()
    settings = RelaySettings(dsn="postgresql://nobody@127.0.0.1:1/none?connect_timeout=1", worker_id="early",
                             kafka_bootstrap_servers=kafka_bootstrap, metrics_port=port, metrics_host="127.0.0.1")
    with running(build_worker(settings)):
        status, body = wait_until(lambda: (r := _try_probe(port, "/healthz")) and r, 10,
                                  message="the health endpoint to answer")
        assert status == 503 and "waiting for the database" in body["problems"][0]


def _try_probe(port: int, path: str) -> tuple[int, dict[str, Any]] | None:
    try:
        return probe(port, path)
    except OSError:
        return None


def test_the_counters_count_what_the_relay_did(dsn: str) -> None:
    """Each counter and histogram against a known history, through a real relay and a real scrape: a
    retry that then succeeds, an event dead-lettered after its attempts, an expired lease taken back by
    this relay's housekeeping, and a writing transaction left open on the server."""
    from prometheus_client import CollectorRegistry

    from outbox_relay import store
    from outbox_relay.metrics import MetricsServer, PrometheusObserver
    from outbox_relay.testing import RecordingSink

    def fail(event: Any, attempt: int) -> str | None:
        if event.key == "bad" or (event.key == "flaky" and attempt == 1):
            return f"refused {event.key} at attempt {attempt}"
        return None

    ids = publish(dsn, [("flaky", "t", {}), ("bad", "t", {}), *[(f"ok-{i}", "t", {}) for i in range(10)]])
    with psycopg.connect(dsn, autocommit=True) as conn:  # a relay declared dead, its lease not expired
        store.register_sink(conn, "kafka", "kafka")
        store.heartbeat(conn, "gone", "alive", ["kafka"], {}, ttl=60.0)
        store.acquire_leases(conn, "kafka", "gone", [7], 600.0)
        conn.execute("UPDATE outbox.workers SET status = 'dead' WHERE id = 'gone'")  # its lease is freed now
    writer = psycopg.connect(dsn)  # a writing transaction that stays open
    writer.execute("CREATE TABLE scratch (n int)")
    sink = RecordingSink("kafka", fail=fail)
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    observer.sinks(["kafka"])
    port = free_port()
    worker = Worker(make_settings(dsn, "counted", max_attempts=2, lease_seconds=5.0), [sink], observer)
    worker.services.append(MetricsServer(worker, registry, "127.0.0.1", port, 0.5))
    try:
        with running(worker):
            sink.wait_for(11, timeout=30)
            samples = wait_until(lambda: (s := scrape(port)) and value(s, "outbox_relay_events_dead_lettered_total",
                                                                        sink="kafka") == 1 and s, 20,
                                 message="the dead letter to be counted")
            assert value(samples, "outbox_relay_events_delivered_total", sink="kafka") == 11
            assert value(samples, "outbox_relay_events_retried_total", sink="kafka") == 2, "flaky once, bad once"
            assert value(samples, "outbox_relay_delivery_latency_seconds_count", sink="kafka") == 11
            batches = value(samples, "outbox_relay_batch_size_events_count", sink="kafka") or 0
            assert batches >= 2 and value(samples, "outbox_relay_batch_size_events_sum", sink="kafka") >= len(ids)
            assert value(samples, "outbox_relay_cycle_failures_total", sink="kafka") == 0
            expired = wait_until(lambda: value(scrape(port), "outbox_relay_leases_expired_total") or 0, 20,
                                 message="housekeeping to take the gone relay's lease back")
            assert expired == 1
            assert (value(scrape(port), "outbox_relay_housekeeping_duration_seconds_count") or 0) >= 1
            oldest_tx = "outbox_relay_oldest_writing_transaction_age_seconds"
            open_for = wait_until(lambda: (age := value(scrape(port), oldest_tx) or 0) >= 1 and age, 20,
                                  message="the open writing transaction's age")
            assert open_for >= 1
            writer.rollback()
            wait_until(lambda: value(scrape(port), oldest_tx) == 0, 20,
                       message="the age to fall back to 0 once the transaction ended")
            assert value(scrape(port), "outbox_relay_buckets_held", sink="kafka") == 256
    finally:
        writer.close()
    assert dead_letters(dsn, "kafka")[ids[1]][0] == 2


def test_a_prepared_transaction_is_the_oldest_writing_transaction(dsn: str) -> None:
    """A prepared (two-phase) transaction has no session left in pg_stat_activity, but it holds the
    vacuum horizon like an open one: the gauge (and its alert) counts it, as `status` does."""
    from prometheus_client import CollectorRegistry

    from outbox_relay.metrics import MetricsServer
    from outbox_relay.testing import RecordingSink

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SHOW max_prepared_transactions").fetchone()
        if row is None or int(row[0]) == 0:
            pytest.skip("the server does not allow prepared transactions (max_prepared_transactions = 0)")
        gid = f"outbox-test-{uuid.uuid4().hex}"
        conn.execute("BEGIN")
        conn.execute("CREATE TABLE held (n int)")
        conn.execute(psycopg.sql.SQL("PREPARE TRANSACTION {}").format(psycopg.sql.Literal(gid)))
    registry = CollectorRegistry()
    port = free_port()
    worker = Worker(make_settings(dsn, "horizon"), [RecordingSink("kafka")])
    worker.services.append(MetricsServer(worker, registry, "127.0.0.1", port, 0.2))
    try:
        with running(worker):
            # Its age grows by the second; the relay's own transactions last milliseconds.
            wait_until(lambda: (value(scrape(port), "outbox_relay_oldest_writing_transaction_age_seconds")
                                or 0) >= 1.0, 20, message="the gauge to count the prepared transaction")
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("ROLLBACK PREPARED {}").format(psycopg.sql.Literal(gid)))
