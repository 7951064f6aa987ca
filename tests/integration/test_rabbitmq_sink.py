"""The RabbitMQ sink against the real broker (tests/rabbitmq_server.py): the contract suite, routing, the message
format, what is the sink's condition and what the event's fault, acknowledgements, secrets, and per-key order
across two consumers of a consistent-hash exchange.

Relays are built as ``outbox-relay run`` builds them (compose.build_worker from settings). Each test has its
own exchanges and queues (a uuid prefix), deleted at its end.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from outbox_relay.compose import build_worker
from outbox_relay.errors import ConfigurationError
from outbox_relay.rabbitmq_settings import RabbitMQSettings
from outbox_relay.settings import load_settings
from outbox_relay.sinks import GiveUp, SinkEvent, SinkUnavailable
from outbox_relay.sinks.rabbitmq import RabbitMQSink, from_settings
from outbox_relay.sinks.rabbitmq.readback import read_back
from outbox_relay.sinks.rabbitmq.sink import refusal
from outbox_relay.testing import SinkContract
from tests.faults.proxy import Proxy
from tests.integration.relay_helpers import dead_letters, make_settings, running
from tests.rabbitmq_server import (
    Namespace,
    channel,
    connect,
    message_count,
    require_consistent_hash,
    require_server,
    take_all,
)
from tests.servers import wait_until

SINK = "rabbitmq"


@pytest.fixture(name="broker")
def _broker() -> str:
    return require_server()


@pytest.fixture(name="ns")
def _ns(broker: str) -> Iterator[Namespace]:
    ns = Namespace()
    try:
        yield ns
    finally:
        ns.delete()


def relay(dsn: str, url: str, worker_id: str = "rmq", **overrides: Any) -> Any:
    # The condition tests wait out holds: shorter than the default 5 s.
    values: dict[str, Any] = {"rabbitmq_url": url, "rabbitmq_concurrency": 2, "rabbitmq_unavailable_seconds": 0.1,
                              **overrides}
    return build_worker(make_settings(dsn, worker_id, **values))


def publish(dsn: str, events: Sequence[tuple[str, str | None, dict[str, Any]]],
            headers: dict[str, str] | None = None) -> list[uuid.UUID]:
    """(key, topic, payload) events in one transaction, in SQL (a topic may be NULL, as SQL producers may
    write); their ids in order."""
    with psycopg.connect(dsn) as conn:
        return [row[0] for k, t, p in events
                for row in conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload, headers) "
                                        "VALUES (%s, %s, 'OrderPlaced', %s, %s) RETURNING id",
                                        (t, k, Jsonb(p), Jsonb(headers or {}))).fetchall()]


def by_key(received: Sequence[Any]) -> dict[str, list[uuid.UUID]]:
    seen: dict[str, list[uuid.UUID]] = defaultdict(list)
    for r in received:
        if r.id not in seen[r.key]:
            seen[r.key].append(r.id)
    return dict(seen)


def event(topic: str | None, key: str = "k", payload: str = '{"n": 1}', **headers: str) -> SinkEvent:
    return SinkEvent(id=uuid.uuid4(), topic=topic, key=key, type="OrderPlaced", payload_json=payload,
                     headers=headers, time=datetime.now(UTC), version=1, attempt=1)


# -- the contract ---------------------------------------------------------------------------------


class TestRabbitMQSinkContract(SinkContract):
    """Every test of the suite through a TCP proxy: "down" closes the proxy (connections cut, new ones refused),
    "hangs" stalls it (a publish waits for its confirm past the time limit). "rejects" is skipped: RabbitMQ
    refuses a message for good only for its size, a server-wide limit (test_faults_... below)."""

    @pytest.fixture(autouse=True)
    def _topology(self, ns: Namespace) -> Iterator[None]:
        self.topic = ns.exchange("contract", "topic")
        self.queue = ns.queue("contract", bind=self.topic)
        self.proxy = Proxy("rabbitmq", ("127.0.0.1", 5672)).start()
        yield
        self.proxy.close()

    def make_sink(self) -> Any:
        return RabbitMQSink(f"amqp://guest:guest@127.0.0.1:{self.proxy.port}/", concurrency=2, heartbeat_seconds=2,
                            unavailable_seconds=0.2)

    def received(self, sink: Any) -> Sequence[uuid.UUID]:
        fields = RabbitMQSettings(rabbitmq_url=require_server(), rabbitmq_queues=[self.queue])
        return [event_id for event_id, _, _ in read_back(fields)]

    def break_downstream(self, sink: Any, how: str) -> contextlib.AbstractContextManager[None]:
        if how == "rejects":
            pytest.skip("RabbitMQ refuses a message for good only for its size (max_message_size, server-wide): "
                        "see test_faults_of_the_event_are_dead_lettered_with_their_reason")
        return self._broken(how)

    @contextlib.contextmanager
    def _broken(self, how: str) -> Iterator[None]:
        if how == "down":
            port = self.proxy.port
            self.proxy.close()
            try:
                yield
            finally:
                self.proxy = Proxy("rabbitmq", ("127.0.0.1", 5672), port=port).start()
        else:
            self.proxy.stall()
            try:
                yield
            finally:
                self.proxy.resume()


# -- routing and the message ----------------------------------------------------------------------


def test_each_topic_goes_to_its_exchange_and_topicless_events_to_the_default(dsn: str, ns: Namespace,
                                                                              broker: str) -> None:
    orders, refunds, other = (ns.exchange(n, "topic") for n in ("orders", "refunds", "other"))
    queues = {x: ns.queue(x.rsplit("-", 1)[1], bind=x) for x in (orders, refunds, other)}
    ids = publish(dsn, [("o1", orders, {"n": 1}), ("r1", refunds, {"n": 2}), ("o1", orders, {"n": 3}),
                        ("x1", None, {"n": 4})])
    with running(relay(dsn, broker, rabbitmq_default_exchange=other)):
        wait_until(lambda: sum(message_count(q) for q in queues.values()) == 4, timeout=20,
                   message="four messages in the queues")
    got = {x: [r.id for r in take_all(q)] for x, q in queues.items()}
    assert got == {orders: [ids[0], ids[2]], refunds: [ids[1]], other: [ids[3]]}


def test_the_message_is_the_cloudevents_amqp_binding_with_the_event_id_as_message_id(dsn: str, ns: Namespace,
                                                                                      broker: str) -> None:
    orders = ns.exchange("orders", "topic")
    queue = ns.queue("orders", bind=orders)
    payload = {"total": 12.5, "items": ["a", "é"]}
    [event_id] = publish(dsn, [("order:7", orders, payload)], headers={"traceparent": "00-abc-01", "tenant": "t1"})
    with running(relay(dsn, broker, source="shop")):
        wait_until(lambda: message_count(queue) == 1, timeout=20, message="the message in the queue")
    [msg] = take_all(queue)
    p = msg.properties
    assert (msg.exchange, msg.key) == (orders, "order:7")  # routing key = partition key
    assert p.message_id == str(event_id) and p.delivery_mode == 2 and p.content_type == "application/json"
    with psycopg.connect(dsn) as conn:
        stored = conn.execute("SELECT payload::text, coalesce(occurred_at, created_at) FROM outbox.events "
                              "WHERE id = %s", (event_id,)).fetchone()
    assert stored is not None and msg.body == stored[0].encode()  # the stored JSON, as is
    headers = p.headers
    assert headers["cloudEvents_id"] == str(event_id)
    assert headers["cloudEvents_specversion"] == "1.0"
    assert headers["cloudEvents_type"] == "OrderPlaced"
    assert headers["cloudEvents_source"] == "shop"
    assert headers["cloudEvents_partitionkey"] == "order:7"
    assert headers["cloudEvents_topic"] == orders
    assert headers["cloudEvents_time"].endswith("Z")
    assert datetime.fromisoformat(headers["cloudEvents_time"]) == stored[1]
    assert headers["traceparent"] == "00-abc-01" and headers["tenant"] == "t1"
    assert not any(name.startswith("cloudEvents:") for name in headers), "one separator for every attribute"


# -- conditions of the sink and faults of the event -----------------------------------------------


def test_an_unroutable_message_holds_its_events_until_a_queue_is_bound(dsn: str, ns: Namespace, broker: str) -> None:
    """mandatory: a message no queue takes comes back, and its event waits (no attempt, no dead letter) until a
    binding exists; a sink that published without mandatory would count it delivered and lose it."""
    orders = ns.exchange("orders", "direct")
    queue = ns.queue("orders")  # not bound yet
    ids = publish(dsn, [("k1", orders, {"n": 1}), ("k1", orders, {"n": 2})])
    worker = relay(dsn, broker)
    with running(worker):
        wait_until(lambda: "routed the message" in " ".join(worker.readiness()), timeout=20, interval=0.01,
                   message="the relay to say its message was unroutable")
        assert dead_letters(dsn, SINK) == {}
        ns.bind(queue, orders, "k1")
        wait_until(lambda: message_count(queue) == 2, timeout=20, message="both messages once a queue is bound")
    assert [r.id for r in take_all(queue)] == ids
    assert dead_letters(dsn, SINK) == {}


def test_a_nack_holds_the_event_until_the_broker_takes_it(dsn: str, ns: Namespace, broker: str) -> None:
    """The ack handling: a queue full with reject-publish nacks; the event is not delivered until the broker
    confirms it. A sink that ignored the nack (or did not wait for the confirm) would lose the nacked events."""
    orders = ns.exchange("orders", "topic")
    queue = ns.queue("orders", bind=orders, **{"x-max-length": 1, "x-overflow": "reject-publish"})
    ids = publish(dsn, [("k1", orders, {"n": n}) for n in range(4)])
    got: list[uuid.UUID] = []
    worker = relay(dsn, broker)
    with running(worker):
        while len(got) < len(ids):
            wait_until(lambda: message_count(queue) == 1, timeout=20, message=f"a message in the queue after {got}")
            if len(got) == 0:
                wait_until(lambda: "nack" in " ".join(worker.readiness()), timeout=20, interval=0.01,
                           message="the relay to say the broker refused the message")
            got.extend(r.id for r in take_all(queue))
    assert got == ids
    assert dead_letters(dsn, SINK) == {}


def test_a_publish_cut_off_before_its_confirm_is_sent_again(ns: Namespace, broker: str) -> None:
    """The ack handling: deliver() returns only once the broker confirmed. A publish held in the network (the
    proxy stalled) is still waiting; when the connection is cut, that message never reached the broker, and the
    sink sends it again on a new connection. A sink that answered before the confirm, or took a lost connection
    for a delivery, would lose it."""
    orders = ns.exchange("orders", "topic")
    queue = ns.queue("orders", bind=orders)
    proxy = Proxy("rabbitmq", ("127.0.0.1", 5672)).start()
    sink = RabbitMQSink(f"amqp://guest:guest@127.0.0.1:{proxy.port}/", unavailable_seconds=0.1)
    lane = concurrent.futures.ThreadPoolExecutor(1)  # one thread, as one of the adapter's lanes: its connection
    try:
        first, second = event(orders), event(orders)
        assert lane.submit(sink.deliver, first).result(10) is not None
        proxy.stall()
        publishing = lane.submit(sink.deliver, second)
        with pytest.raises(concurrent.futures.TimeoutError):
            publishing.result(0.5)  # "deliver() returned before the broker could confirm" otherwise
        proxy.cut()
        proxy.resume()
        assert type(publishing.result(10)).__name__ == "Delivered"
        assert [r.id for r in take_all(queue)] == [first.id, second.id]
    finally:
        lane.shutdown()
        sink.close()
        proxy.close()


def test_a_missing_exchange_holds_until_it_exists_or_is_declared(dsn: str, ns: Namespace, broker: str) -> None:
    orders = ns.name("orders")
    sink = RabbitMQSink(broker, unavailable_seconds=0.1)
    declaring = RabbitMQSink(broker, declare_exchange="topic")
    try:
        with pytest.raises(SinkUnavailable, match="does not exist"):
            sink.deliver(event(orders))
        ns.exchanges.append(orders)  # deleted at the end
        with pytest.raises(SinkUnavailable, match="routed the message"):  # declared, nothing bound yet
            declaring.deliver(event(orders))
        queue = ns.queue("orders", bind=orders)
        assert sink.deliver(event(orders, "k2")) is not None  # the same sink, its channel reopened
        assert message_count(queue) == 1
        other_type = RabbitMQSink(broker, declare_exchange="fanout")
        with contextlib.closing(other_type), pytest.raises(SinkUnavailable, match="not what --rabbitmq-declare"):
            other_type.deliver(event(orders))  # it exists as another type
    finally:
        sink.close()
        declaring.close()


def test_faults_of_the_event_are_dead_lettered_with_their_reason(dsn: str, ns: Namespace, broker: str) -> None:
    orders = ns.exchange("orders", "topic")
    queue = ns.queue("orders", bind=orders)
    long_key = "k" * 256
    ids = publish(dsn, [(long_key, orders, {"n": 1}), ("big", orders, {"blob": "x" * 2000}), ("none", None, {}),
                        ("fine", orders, {"n": 2})])
    with running(relay(dsn, broker, rabbitmq_max_message_bytes=1000)):
        wait_until(lambda: len(dead_letters(dsn, SINK)) == 3 and message_count(queue) == 1, timeout=20,
                   message="three dead letters and one message")
    dead = dead_letters(dsn, SINK)
    assert "256 bytes; an AMQP routing key is at most 255" in dead[ids[0]][1]
    assert "over the broker's limit of 1000" in dead[ids[1]][1]
    assert "no topic and the sink has no default exchange" in dead[ids[2]][1]
    assert all(attempts == 1 for attempts, _ in dead.values())
    assert [r.id for r in take_all(queue)] == [ids[3]]


def test_the_broker_refusing_a_message_for_its_size_is_the_events_fault() -> None:
    """The broker's own size check (max_message_size, server-wide: not changed on a shared broker) closes the
    channel with 406; the sink reads that as the event's fault, and any other close as the sink's."""
    assert isinstance(refusal(406, "PRECONDITION_FAILED - message size 200 is larger than configured max size 100",
                              "x"), GiveUp)
    assert "may not write" in str(refusal(403, "ACCESS_REFUSED", "x"))
    assert "does not exist" in str(refusal(404, "NOT_FOUND - no exchange 'x'", "x"))


def test_broker_down_and_credentials_refused_hold_and_say_so_without_the_password(broker: str) -> None:
    secret = "s3cret-Pa55word"
    down = RabbitMQSink(f"amqp://guest:{secret}@127.0.0.1:1/", unavailable_seconds=0.1)
    with contextlib.closing(down), pytest.raises(SinkUnavailable, match="can not connect") as refused:
        down.deliver(event("x"))
    wrong = RabbitMQSink(f"amqp://guest:{secret}@127.0.0.1:5672/")
    with contextlib.closing(wrong), pytest.raises(SinkUnavailable, match="refuses the credentials") as denied:
        wrong.deliver(event("x"))
    vhost = RabbitMQSink("amqp://guest:guest@127.0.0.1:5672/no-such-vhost")
    with contextlib.closing(vhost), pytest.raises(SinkUnavailable, match="may not use vhost 'no-such-vhost'"):
        vhost.deliver(event("x"))
    for exc in (refused.value, denied.value):
        assert secret not in str(exc) and secret not in repr(down) and "guest:" not in str(exc)
    assert denied.value.retry_after_seconds == 30.0


# -- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("values", "error"), [
    ({"rabbitmq_url": "http://host/"}, "must start with amqp:// or amqps://"),
    ({"rabbitmq_url": "amqp:///vhost"}, "has no host"),
    ({"rabbitmq_url": "amqp://host/a/b"}, "percent-encode a /"),
    ({"rabbitmq_url": "amqp://host/?heartbeat=5"}, "no ?query"),
    ({"rabbitmq_url": "amqp://host:x/"}, "can not be parsed"),
    ({"rabbitmq_url": "amqp://host/", "rabbitmq_ca_file": "/ca.pem"}, "need an amqps:// URL"),
    ({"rabbitmq_url": "amqps://host/", "rabbitmq_client_key": "/k.pem"}, "needs --rabbitmq-client-cert"),
    ({"rabbitmq_url": "amqp://host/", "rabbitmq_topics": "orders,bad topic"}, "is not an AMQP name"),
    ({"rabbitmq_url": "amqp://host/", "rabbitmq_default_exchange": "a/b"}, "not an exchange name"),
    ({"rabbitmq_url": "amqp://host/", "rabbitmq_declare_exchange": "weird"}, "rabbitmq_declare_exchange"),
    ({"rabbitmq_url": "amqp://host/", "rabbitmq_password_file": "/no/such/file"}, "cannot read the RabbitMQ password"),
    ({"rabbitmq_url": "amqp://host/", "rabbitmq_concurrency": 0}, "rabbitmq_concurrency"),
    ({"rabbitmq_url": "amqp://host/", "rabbitmq_sink": "Bad Name"}, "rabbitmq_sink"),
])
def test_settings_errors_name_the_problem(values: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigurationError, match=error.replace("?", r"\?").replace("/", "/")):
        load_settings(dsn="postgresql://x@h/db", kafka=False, **values)


def test_settings_build_the_sink_and_keep_the_password_out_of_errors(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    secret = "file-Pa55word-0"
    (tmp_path / "pw").write_text(secret + "\n")
    s = load_settings(dsn="postgresql://x@h/db", kafka=False, rabbitmq_url="amqp://app@127.0.0.1:1/orders",
                      rabbitmq_password_file=str(tmp_path / "pw"), rabbitmq_concurrency=3,
                      rabbitmq_topics="orders, refunds", rabbitmq_sink="rmq")
    assert s.sinks == ["rmq"]
    sink = from_settings(s, s.source)
    assert (sink.name, sink.kind, sink.concurrency, sink.topics) == ("rmq", "rabbitmq", 3, {"orders", "refunds"})
    assert sink.endpoint == "amqp://127.0.0.1:1/orders" and sink.broker.username == "app"
    with contextlib.closing(sink), caplog.at_level(logging.DEBUG), pytest.raises(SinkUnavailable) as down:
        sink.deliver(event("orders"))
    assert secret not in str(down.value) and secret not in caplog.text
    with pytest.raises(ConfigurationError) as both:
        load_settings(dsn="postgresql://x@h/db", kafka=False, rabbitmq_url=f"amqp://app:{secret}x@h/",
                      rabbitmq_password=secret, rabbitmq_password_file=str(tmp_path / "pw"))
    assert "not both" in str(both.value) and secret not in str(both.value)


def test_import_outbox_relay_does_not_load_pika_and_a_missing_extra_is_one_clear_error() -> None:
    import subprocess
    import sys

    code = ("import sys, outbox_relay, outbox_relay.compose, outbox_relay.sinks.rabbitmq\n"
            "print('pika' in sys.modules)\n"
            "sys.modules['pika'] = None  # as if the extra were not installed\n"
            "from outbox_relay.errors import ConfigurationError\n"
            "try:\n"
            "    outbox_relay.sinks.rabbitmq.RabbitMQSink('amqp://h/')\n"
            "except ConfigurationError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.splitlines() == ["False",
                                "the rabbitmq sink needs `pip install outbox-relay[rabbitmq]` (the pika client)"]


# -- read-back and order across consumers ----------------------------------------------------------


def test_read_back_puts_every_message_back_in_its_place(ns: Namespace, broker: str) -> None:
    orders, refunds = ns.exchange("orders", "topic"), ns.exchange("refunds", "topic")
    queue = ns.queue("all", bind=orders)
    ns.bind(queue, refunds, "#")
    sink = RabbitMQSink(broker)
    try:
        sent = [sink_event for sink_event in (event(orders, "a"), event(refunds, "b"), event(orders, "a"))]
        for e in sent:
            sink.deliver(e)
        with channel() as ch:  # a message that is not the sink's is left out
            ch.basic_publish(orders, "z", b"{}")
    finally:
        sink.close()
    fields = RabbitMQSettings(rabbitmq_url=broker, rabbitmq_queues=[queue])
    everything = [(e.id, e.key, queue) for e in sent]
    assert read_back(fields) == everything
    assert read_back(fields, topics=[refunds]) == [everything[1]]
    assert read_back(fields) == everything, "a second read finds the same: the first put everything back"
    assert message_count(queue) == 4


def test_two_consumers_of_a_consistent_hash_exchange_see_each_key_in_order(dsn: str, ns: Namespace,
                                                                           broker: str) -> None:
    """The topology of docs/rabbitmq.md: the routing key (the partition key) is hashed to one of the bound
    queues, each queue has one consumer, so each key is in one queue, in order, and the consumers share the keys."""
    require_consistent_hash()
    orders = ns.exchange("orders", "x-consistent-hash")
    queues = [ns.queue(f"part{i}", bind=orders, routing_key="1") for i in range(2)]  # equal weights
    keys = [f"order:{i}" for i in range(12)]
    ids = publish(dsn, [(keys[n % len(keys)], orders, {"n": n}) for n in range(120)])
    want: dict[str, list[uuid.UUID]] = defaultdict(list)
    for n, event_id in enumerate(ids):
        want[keys[n % len(keys)]].append(event_id)
    seen: dict[str, list[tuple[str, str, uuid.UUID]]] = {q: [] for q in queues}
    done = threading.Event()

    def consume(queue: str) -> None:
        conn = connect()
        try:
            ch = conn.channel()
            ch.basic_qos(prefetch_count=10)
            for method, properties, _ in ch.consume(queue, inactivity_timeout=0.1):
                if method is not None:
                    seen[queue].append((queue, method.routing_key, uuid.UUID(properties.message_id)))
                    ch.basic_ack(method.delivery_tag)
                elif done.is_set():
                    break
        finally:
            conn.close()

    consumers = [threading.Thread(target=consume, args=(q,)) for q in queues]
    for c in consumers:
        c.start()
    try:
        with running(relay(dsn, broker, rabbitmq_concurrency=4)):
            wait_until(lambda: sum(map(len, seen.values())) >= len(ids), timeout=30, message="every message consumed")
    finally:
        done.set()
        for c in consumers:
            c.join(10)
    got: dict[str, list[uuid.UUID]] = defaultdict(list)
    queue_of: dict[str, set[str]] = defaultdict(set)
    for queue in queues:
        for _, key, event_id in seen[queue]:
            queue_of[key].add(queue)
            if event_id not in got[key]:
                got[key].append(event_id)
    assert dict(got) == dict(want)
    assert all(len(qs) == 1 for qs in queue_of.values()), "each key is in one queue"
    assert all(seen[q] for q in queues), "both consumers got keys"
