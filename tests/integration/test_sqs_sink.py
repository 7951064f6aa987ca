"""The SQS sink against a real SQS endpoint over HTTP (moto's server mode, tests/sqs_server.py; or
``OUTBOX_TEST_SQS_URL``), real PostgreSQL, the real relay (compose.build_worker from settings with
``sqs_url``, as ``outbox-relay run --sqs-url`` builds it).

What reached SQS is read back from the queues (``read_back``, which consumes); every test has queues
of its own (a uuid prefix) and deletes them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_relay.compose import build_worker
from outbox_relay.publish import Outbox
from outbox_relay.sinks.sqs import SqsSink
from outbox_relay.sinks.sqs.message import group_id
from outbox_relay.sinks.sqs.readback import read_back
from outbox_relay.sqs_settings import SqsSettings
from outbox_relay.testing import SinkContract
from tests.integration.relay_helpers import dead_letters, fetch_all, make_settings, parked_ids, publish, running
from tests.servers import wait_until
from tests.sqs_server import QUIET, MotoServer, Namespace, client, use_dummy_credentials

SINK = "sqs"
TOPIC = "orders"
FAST = {"sqs_unavailable_seconds": 0.2, "sqs_timeout_seconds": 2.0, "sqs_connect_timeout_seconds": 1.0}


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer | None]:
    """This module's SQS endpoint: moto as a subprocess, or None when OUTBOX_TEST_SQS_URL names one."""
    if os.environ.get("OUTBOX_TEST_SQS_URL"):
        yield None
        return
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log").start()
    try:
        yield server
    finally:
        with contextlib.suppress(Exception):
            server.resume()
        server.kill()


@pytest.fixture
def endpoint(moto: MotoServer | None, monkeypatch: pytest.MonkeyPatch) -> str:
    if moto is None:
        return os.environ["OUTBOX_TEST_SQS_URL"]
    use_dummy_credentials(monkeypatch)
    if moto.process is None:  # a test that restarted it failed half-way
        moto.start()
    return moto.url


@pytest.fixture
def ns(endpoint: str) -> Iterator[Namespace]:
    namespace = Namespace(endpoint)
    try:
        yield namespace
    finally:
        namespace.close()


class Reader:
    """Everything read back from a namespace's queues so far (read_back consumes: it is kept here)."""

    def __init__(self, endpoint: str, ns: Namespace) -> None:
        self.fields = SqsSettings(sqs_url=endpoint, sqs_queue_prefix=ns.prefix)
        self.got: list[tuple[uuid.UUID, str, str]] = []

    def read(self) -> list[tuple[uuid.UUID, str, str]]:
        self.got += read_back(self.fields, timeout_seconds=30, quiet_seconds=QUIET)
        return self.got

    def ids(self) -> set[uuid.UUID]:
        return {i for i, _k, _q in self.got}

    def per_key(self) -> dict[str, list[uuid.UUID]]:
        """Per key, the ids in queue order, each once (its first time)."""
        seen: set[uuid.UUID] = set()
        out: dict[str, list[uuid.UUID]] = defaultdict(list)
        for i, key, _q in self.got:
            if i not in seen:
                seen.add(i)
                out[key].append(i)
        return dict(out)


def relay(dsn: str, endpoint: str, ns: Namespace, worker_id: str = "w1", **overrides: Any) -> Any:
    values: dict[str, Any] = {"sqs_url": endpoint, "sqs_queue_prefix": ns.prefix, "sqs_concurrency": 8, **FAST}
    values.update(overrides)
    return build_worker(make_settings(dsn, worker_id, **values))


def batch(keys: int, per_key: int) -> list[tuple[str, str, Any]]:
    return [(f"key-{k}", "order.placed", {"k": k, "n": n}) for n in range(per_key) for k in range(keys)]


def per_key(events: list[tuple[str, str, Any]], ids: list[uuid.UUID]) -> dict[str, list[uuid.UUID]]:
    out: dict[str, list[uuid.UUID]] = defaultdict(list)
    for (key, _t, _p), event_id in zip(events, ids, strict=True):
        out[key].append(event_id)
    return dict(out)


def receive_all(ns: Namespace, topic: str) -> list[dict[str, Any]]:
    """Every message of a queue with its attributes (received and deleted)."""
    url = ns.sqs.get_queue_url(QueueName=ns.name(topic))["QueueUrl"]
    out: list[dict[str, Any]] = []
    while True:
        got = ns.sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=60, WaitTimeSeconds=0,
                                     MessageAttributeNames=["All"], MessageSystemAttributeNames=["All"])
        messages = got.get("Messages") or []
        if not messages:
            return out
        out += messages
        ns.sqs.delete_message_batch(QueueUrl=url, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                                                           for i, m in enumerate(messages)])


def pending(dsn: str, sink: str = SINK) -> int:
    """Events of ``sink`` neither delivered nor dead-lettered yet (parked ones included); -1 before the
    sink has cursors."""
    if not fetch_all(dsn, "SELECT 1 FROM outbox.cursors WHERE sink = %s LIMIT 1", (sink,)):
        return -1
    unread = fetch_all(dsn, "SELECT count(*) FROM outbox.events e JOIN outbox.cursors c ON c.sink = %s "
                            "AND c.bucket = e.bucket WHERE NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, "
                            "c.target, c.after_xid, c.after_seq)", (sink,))[0][0]
    parked = fetch_all(dsn, "SELECT count(*) FROM outbox.parked WHERE sink = %s", (sink,))[0][0]
    return int(unread) + int(parked)


# -- the contract -------------------------------------------------------------------------------


class TestSqsSinkContract(SinkContract):
    @pytest.fixture(autouse=True)
    def _queues(self, endpoint: str, ns: Namespace, moto: MotoServer | None) -> None:
        self.endpoint, self.ns, self.moto = endpoint, ns, moto
        ns.create(self.topic)
        self.reader = Reader(endpoint, ns)

    def make_sink(self) -> Any:
        return SqsSink(self.endpoint, queue_prefix=self.ns.prefix, concurrency=4, unavailable_seconds=0.2,
                       timeout_seconds=2.0, connect_timeout_seconds=1.0)

    def received(self, sink: Any) -> Sequence[uuid.UUID]:
        return [i for i, _k, _q in self.reader.read()]

    def break_downstream(self, sink: Any, how: str) -> contextlib.AbstractContextManager[None]:
        if self.moto is None or how == "rejects":
            return super().break_downstream(sink, how)
        return self._away() if how == "down" else self._paused()

    @contextlib.contextmanager
    def _away(self) -> Iterator[None]:
        assert self.moto is not None
        self.reader.read()  # moto forgets everything when it stops
        self.moto.kill()
        try:
            yield
        finally:
            self.moto.start()
            self.ns.create(self.topic)

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        assert self.moto is not None
        self.moto.pause()
        try:
            yield
        finally:
            self.moto.resume()


# -- delivery and the message -------------------------------------------------------------------


def test_every_event_arrives_once_in_order_per_key_as_a_cloudevent(dsn: str, endpoint: str, ns: Namespace) -> None:
    ns.create(TOPIC)
    events = batch(keys=8, per_key=10)
    events += [("Zürich order 7", "order.placed", {"k": 99, "n": n}) for n in range(5)]  # no MessageGroupId
    outbox = Outbox(default_topic=TOPIC)
    with psycopg.connect(dsn) as conn:
        ids = [p.id for p in outbox.publish_many(conn, [
            {"key": k, "type": t, "payload": p, "headers": {"traceparent": f"00-{p['k']:032x}-{p['n']:016x}-01"}}
            for k, t, p in events])]
    with running(relay(dsn, endpoint, ns)):
        wait_until(lambda: pending(dsn) == 0, timeout=30, message="every event delivered")
    messages = receive_all(ns, TOPIC)
    assert len(messages) == len(ids), "each event once (no fault, no duplicate)"
    got: dict[str, list[uuid.UUID]] = defaultdict(list)
    groups: dict[str, set[str]] = defaultdict(set)
    for m in messages:
        key = m["MessageAttributes"]["ce-partitionkey"]["StringValue"]
        got[key].append(uuid.UUID(m["MessageAttributes"]["ce-id"]["StringValue"]))
        groups[key].add(m["Attributes"]["MessageGroupId"])
    assert dict(got) == per_key(events, ids), "per key (message group), the publish order"
    assert groups["Zürich order 7"] == {group_id("Zürich order 7")} and groups["key-1"] == {"key-1"}
    stored = {r[0]: r for r in fetch_all(dsn, "SELECT id, payload::text, occurred_at FROM outbox.events")}
    for m in messages:
        a = {name: v["StringValue"] for name, v in m["MessageAttributes"].items()}
        event_id = uuid.UUID(a["ce-id"])
        assert m["Attributes"]["MessageDeduplicationId"] == str(event_id)
        assert json.loads(m["Body"]) == json.loads(stored[event_id][1])
        assert len(a) <= 10, "SQS takes at most 10 attributes"
        assert a["ce-specversion"] == "1.0" and a["ce-type"] == "order.placed" and a["ce-source"] == "outbox-relay"
        assert a["ce-topic"] == TOPIC and a["ce-datacontenttype"] == "application/json"
        assert a["ce-time"].endswith("Z") and a["ce-schemaversion"] == "1"
        payload = json.loads(m["Body"])
        assert json.loads(a["outbox-headers"]) == {"traceparent": f"00-{payload['k']:032x}-{payload['n']:016x}-01"}


# -- routing ------------------------------------------------------------------------------------


def test_each_topic_goes_to_its_own_queue(dsn: str, endpoint: str, ns: Namespace) -> None:
    ns.create("orders")
    ns.create("refunds")
    mapped = ns.create("elsewhere")
    orders = publish(dsn, [("k", "t", {"n": 1})], topic="orders")
    refunds = publish(dsn, [("k", "t", {"n": 2})], topic="refunds")
    dotted = publish(dsn, [("k", "t", {"n": 4})], topic="audit.v1")  # no queue name can hold a "."
    remapped = publish(dsn, [("k", "t", {"n": 5})], topic="payments.v2")
    skipped = publish(dsn, [("k", "t", {"n": 6})], topic="ignored")
    worker = relay(dsn, endpoint, ns, sqs_queue_urls={"payments.v2": mapped}, sqs_sink="sqs-eu",
                   sqs_topics="orders,refunds,audit.v1,payments.v2")
    with running(worker):
        wait_until(lambda: pending(dsn, "sqs-eu") == 0, timeout=30, message="every event delivered or dead-lettered")
    assert fetch_all(dsn, "SELECT name, kind FROM outbox.sinks") == [("sqs-eu", "sqs")]
    reader = Reader(endpoint, ns)
    by_queue = {i: q for i, _k, q in reader.read()}
    assert by_queue == {orders[0]: ns.name("orders"), refunds[0]: ns.name("refunds"),
                        remapped[0]: ns.name("elsewhere")}
    dead = dead_letters(dsn, "sqs-eu")
    assert list(dead) == [dotted[0]], "the topic no queue name can hold is dead-lettered, the others delivered"
    assert "audit.v1" in dead[dotted[0]][1] and "--sqs-queue-urls" in dead[dotted[0]][1]
    assert skipped[0] not in by_queue, "--sqs-topics: other topics are not this sink's"


def test_a_standard_queue_is_taken_only_when_allowed_and_gets_no_group(dsn: str, endpoint: str, ns: Namespace) -> None:
    url = ns.create("plain", fifo=False)
    with pytest.raises(ValueError, match=r"standard queue.*--sqs-allow-standard-queue"):
        make_settings(dsn, "w1", sqs_url=endpoint, sqs_queue_urls={"plain": url})
    ids = publish(dsn, [("k", "t", {"n": n}) for n in range(3)], topic="plain")
    worker = relay(dsn, endpoint, ns, sqs_queue_urls={"plain": url}, sqs_allow_standard_queue=True)
    with running(worker):
        wait_until(lambda: pending(dsn) == 0, timeout=30, message="every event delivered")
    messages = _receive_url(ns, url)
    assert sorted(uuid.UUID(m["MessageAttributes"]["ce-id"]["StringValue"]) for m in messages) == sorted(ids)
    assert all("MessageGroupId" not in m["Attributes"] for m in messages)


def _receive_url(ns: Namespace, url: str) -> list[dict[str, Any]]:
    got = ns.sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=0,
                                 MessageAttributeNames=["All"], MessageSystemAttributeNames=["All"])
    return list(got.get("Messages") or [])


# -- the event's fault and the sink's condition ------------------------------------------------


def test_a_missing_queue_holds_its_events_until_it_exists(dsn: str, endpoint: str, ns: Namespace,
                                                          caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    secret, token = f"SECRETKEY{uuid.uuid4().hex}", f"SESSIONTOKEN{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    caplog.set_level(logging.DEBUG, logger="outbox_relay")
    events = batch(keys=3, per_key=3)
    ids = publish(dsn, events, topic=TOPIC)
    with running(relay(dsn, endpoint, ns, max_attempts=2)):
        # several holds (0.2 s each), more than max_attempts would allow if they counted
        wait_until(lambda: caplog.text.count("does not exist") >= 3, timeout=15, message="three holds")
        assert dead_letters(dsn, SINK) == {}
        attempts, errors = fetch_all(dsn, "SELECT max(attempts), string_agg(last_error, ' ') FROM outbox.parked "
                                          "WHERE sink = %s", (SINK,))[0]
        assert attempts in (0, None), "a condition of the sink counts no attempt"
        assert "does not exist" in errors and secret not in errors and token not in errors
        ns.create(TOPIC)
        wait_until(lambda: pending(dsn) == 0, timeout=30, message="every event delivered")
    reader = Reader(endpoint, ns)
    reader.read()
    assert reader.per_key() == per_key(events, ids)
    assert dead_letters(dsn, SINK) == {}
    assert "does not exist" in caplog.text
    assert secret not in caplog.text and token not in caplog.text


def test_a_message_sqs_refuses_is_dead_lettered_with_its_reason_and_the_batch_goes_on(
        dsn: str, endpoint: str, ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    # The ack handling: SQS refuses the request for one message's sake; the others must still be sent
    # and counted only once SQS took them, the refused one dead-lettered with SQS's reason.
    secret = f"SECRETKEY{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    ns.create(TOPIC, MaximumMessageSize="1024")
    events = [(f"key-{k}", "t", {"k": k, "pad": "x" * (2000 if k == 3 else 10)}) for k in range(8)]
    events += [("key-3", "t", {"k": 3, "after": True}), ("key-5", "t", {"text": "\ufffe"}), ("key-5", "t", {})]
    ids = publish(dsn, events, topic=TOPIC)
    with running(relay(dsn, endpoint, ns, sqs_concurrency=8)):
        wait_until(lambda: pending(dsn) == 0, timeout=30, message="every event delivered or dead-lettered")
    dead = dead_letters(dsn, SINK)
    assert set(dead) == {ids[3], ids[9]}
    attempts, error = dead[ids[3]]
    assert attempts == 1 and "InvalidParameterValue" in error and "1024" in error, error
    assert "U+FFFE" in dead[ids[9]][1], "a character SQS refuses is the event's fault"
    assert all(secret not in error for _n, error in dead.values())
    reader = Reader(endpoint, ns)
    reader.read()
    assert reader.ids() == set(ids) - {ids[3], ids[9]}, "every other event reached the queue, the keys went on"


def test_credentials_sqs_refuses_hold_the_events_and_dead_letter_none(dsn: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # moto checking signatures (after the first 4 requests, which make the queue, a user and its key)
    use_dummy_credentials(monkeypatch)
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "4")
    server = MotoServer(tmp_path / "moto.log").start()
    monkeypatch.delenv("INITIAL_NO_AUTH_ACTION_COUNT")
    try:
        ns = Namespace(server.url)
        url = ns.create(TOPIC)
        iam = ns.iam()
        iam.create_user(UserName="relay")
        key = iam.create_access_key(UserName="relay")["AccessKey"]
        iam.put_user_policy(UserName="relay", PolicyName="sqs", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sqs:*", "Resource": "*"}]}))
        ids = publish(dsn, [("k", "t", {"n": n}) for n in range(3)], topic=TOPIC)
        # The queue by URL: the send itself is refused (no lookup first).
        with running(relay(dsn, server.url, ns, max_attempts=1, sqs_queue_urls={TOPIC: url})):
            wait_until(lambda: fetch_all(dsn, "SELECT count(*) FROM outbox.parked WHERE sink = 'sqs' AND "
                                              "last_error LIKE '%%a condition of the sink%%'")[0][0] > 0,
                       timeout=15, message="the events held")
        assert dead_letters(dsn, SINK) == {}, "refused credentials are no fault of the events"
        [error] = fetch_all(dsn, "SELECT DISTINCT last_error FROM outbox.parked WHERE sink = 'sqs'")[0]
        assert "InvalidClientTokenId: The security token included in the request is invalid" in error, error
        assert fetch_all(dsn, "SELECT max(attempts) FROM outbox.parked WHERE sink = 'sqs'")[0][0] == 0
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        with running(relay(dsn, server.url, ns, max_attempts=1, sqs_queue_urls={TOPIC: url})):
            wait_until(lambda: pending(dsn) == 0, timeout=30, message="every event delivered")
        ns.sqs = client(server.url)  # signed with the user's key too
        assert [uuid.UUID(m["MessageAttributes"]["ce-id"]["StringValue"]) for m in receive_all(ns, TOPIC)] == ids
    finally:
        server.kill()


def test_nothing_counts_delivered_before_sqs_answered(dsn: str, endpoint: str, ns: Namespace,
                                                      moto: MotoServer | None) -> None:
    # While the endpoint takes requests and never answers (SIGSTOP), no event may count as delivered;
    # once it answers, every one is, in order. A sink that did not wait for SQS's answer fails here.
    if moto is None:
        pytest.skip("needs the test's own endpoint (it is stopped)")
    ns.create(TOPIC)
    events = batch(keys=4, per_key=3)
    first = publish(dsn, [("key-0", "t", {"first": True})], topic=TOPIC)
    try:
        with running(relay(dsn, endpoint, ns, sqs_timeout_seconds=0.5)):
            wait_until(lambda: pending(dsn) == 0, timeout=30, message="the first event delivered (queue known)")
            moto.pause()
            ids = publish(dsn, events, topic=TOPIC)
            wait_until(lambda: parked_ids(dsn, SINK) or pending(dsn) == 0, timeout=15, message="the events held")
            assert pending(dsn) == len(ids), "nothing counted delivered while SQS did not answer"
            moto.resume()
            wait_until(lambda: pending(dsn) == 0, timeout=30, message="every event delivered")
    finally:
        moto.resume()
    assert dead_letters(dsn, SINK) == {}
    reader = Reader(endpoint, ns)
    reader.read()
    want = per_key(events, ids)
    want["key-0"] = first + want["key-0"]
    assert reader.per_key() == want


# -- settings -----------------------------------------------------------------------------------


def test_no_credentials_is_a_clear_error_at_start(endpoint: str, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    from outbox_relay.errors import ConfigurationError

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ConfigurationError, match="no AWS credentials"):
        SqsSink(endpoint, region="us-east-1")
    with pytest.raises(ConfigurationError, match="profile 'nobody'"):
        SqsSink(endpoint, region="us-east-1", profile="nobody")
