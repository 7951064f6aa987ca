"""The SQS sink's parts that need no server: settings and their errors, the message, queue names, what
SQS's answers mean, a wave's requests (tests/integration/test_sqs_sink.py runs them against an endpoint)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from outbox_relay.settings import RelaySettings
from outbox_relay.sinks import GiveUp, Retry, SinkEvent, SinkUnavailable
from outbox_relay.sinks.sqs import SqsSink
from outbox_relay.sinks.sqs.answers import of_error
from outbox_relay.sinks.sqs.batches import requests
from outbox_relay.sinks.sqs.client import region_of
from outbox_relay.sinks.sqs.message import Message, group_id, message_of
from outbox_relay.sinks.sqs.queues import Queues
from outbox_relay.sqs_settings import SqsSettings

DSN = "postgresql://u@h/d"
QUEUE = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo"


def event(**changes: Any) -> SinkEvent:
    values: dict[str, Any] = {"id": uuid.uuid4(), "topic": "orders", "key": "order-1", "type": "order.placed",
                              "payload_json": '{"n": 1}', "headers": {"traceparent": "00-abc-def-01"},
                              "time": datetime(2026, 12, 2, 12, 0, tzinfo=UTC), "version": 2, "attempt": 1}
    values.update(changes)
    return SinkEvent(**values)


# -- settings -------------------------------------------------------------------------------------


def test_the_sink_is_off_until_its_url_is_given_and_listed_then() -> None:
    assert "sqs" not in RelaySettings(dsn=DSN, kafka=False).sinks
    s = RelaySettings(dsn=DSN, kafka=False, sqs_url="https://sqs.eu-west-1.amazonaws.com", sqs_sink="sqs-eu")
    assert s.sinks == ["sqs-eu"]


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_SQS_URL", "http://127.0.0.1:4566")
    monkeypatch.setenv("OUTBOX_SQS_QUEUE_URLS", f"orders={QUEUE}, audit.v1={QUEUE.replace('orders', 'audit')}")
    monkeypatch.setenv("OUTBOX_SQS_TOPICS", "orders,audit.v1")
    s = SqsSettings()
    assert s.sqs_queue_urls == {"orders": QUEUE, "audit.v1": QUEUE.replace("orders", "audit")}
    assert s.sqs_topics == ["orders", "audit.v1"]


@pytest.mark.parametrize(("values", "message"), [
    ({"sqs_url": "ftp://x"}, "http:// or https://"),
    ({"sqs_url": "https://AKIAEXAMPLE:hunter2@sqs.eu-west-1.amazonaws.com"}, "credentials do not go in the SQS URL"),
    ({"sqs_region": "Europe"}, "not an AWS region"),
    ({"sqs_queue_prefix": "my.prefix"}, "prefix is at most 74 characters of A-Z"),
    ({"sqs_sink": "SQS"}, "sqs_sink: a sink name"),
    ({"sqs_topics": "orders,bad topic"}, "is not a topic name"),
    ({"sqs_queue_urls": "orders"}, "is not TOPIC=QUEUE_URL"),
    ({"sqs_queue_urls": {"orders": "https://sqs.eu-west-1.amazonaws.com/1/plain"}}, "standard queue"),
    ({"sqs_queue_urls": {"orders": "https://sqs.eu-west-1.amazonaws.com/1/a.b.fifo"}}, "does not end in a queue"),
    ({"sqs_batch_size": 11}, "less than or equal to 10"),
])
def test_bad_settings_are_refused_by_name(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message) as raised:
        SqsSettings(**values)
    assert "hunter2" not in str(raised.value)


def test_a_standard_queue_is_accepted_when_allowed() -> None:
    url = "https://sqs.eu-west-1.amazonaws.com/1/plain"
    s = SqsSettings(sqs_queue_urls={"orders": url}, sqs_allow_standard_queue=True)
    assert s.sqs_queue_urls == {"orders": url}


def test_run_help_lists_the_sqs_options() -> None:
    out = subprocess.run([sys.executable, "-m", "outbox_relay.cli", "run", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for option in ("--sqs-url", "--sqs-queue-prefix", "--sqs-queue-urls", "--sqs-allow-standard-queue",
                   "--sqs-region", "--sqs-profile", "--sqs-concurrency", "--sqs-batch-size", "OUTBOX_SQS_URL"):
        assert option in out, option


def test_importing_the_sink_does_not_import_boto3() -> None:
    code = "import sys, outbox_relay.sinks.sqs, outbox_relay.settings; print('boto3' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_region_of_an_aws_endpoint() -> None:
    assert region_of("https://sqs.eu-west-1.amazonaws.com") == "eu-west-1"
    assert region_of("https://sqs-fips.us-gov-west-1.amazonaws.com") == "us-gov-west-1"
    assert region_of("https://vpce-0a1b.sqs.ap-south-1.vpce.amazonaws.com") == "ap-south-1"
    assert region_of("http://127.0.0.1:4566") is None


# -- the message ----------------------------------------------------------------------------------


def test_the_message_carries_the_cloudevent_in_at_most_ten_attributes() -> None:
    e = event()
    m = message_of(e, "billing", fifo=True)
    assert isinstance(m, Message)
    attributes = {n: v["StringValue"] for n, v in m.entry["MessageAttributes"].items()}
    assert attributes == {"ce-specversion": "1.0", "ce-id": str(e.id), "ce-source": "billing",
                          "ce-type": "order.placed", "ce-time": "2026-12-02T12:00:00Z", "ce-partitionkey": "order-1",
                          "ce-schemaversion": "2", "ce-datacontenttype": "application/json", "ce-topic": "orders",
                          "outbox-headers": '{"traceparent":"00-abc-def-01"}'}
    assert len(attributes) <= 10
    assert m.entry["MessageBody"] == '{"n": 1}'
    assert m.entry["MessageGroupId"] == "order-1" and m.entry["MessageDeduplicationId"] == str(e.id)
    assert m.size == len('{"n": 1}') + sum(len(n) + 6 + len(v) for n, v in attributes.items())
    standard = message_of(e, "billing", fifo=False)
    assert isinstance(standard, Message)
    assert "MessageGroupId" not in standard.entry and "MessageDeduplicationId" not in standard.entry


def test_a_character_sqs_refuses_is_given_up_before_sending() -> None:
    assert isinstance(message_of(event(payload_json='"\ufffe"'), "s", True), GiveUp)
    refused = message_of(event(key="a\ufffeb"), "s", True)
    assert isinstance(refused, GiveUp) and "ce-partitionkey" in refused.reason and "U+FFFE" in refused.reason
    kept = message_of(event(headers={"x": "a\x01\ufffe"}), "s", True)  # headers travel as ASCII JSON
    assert isinstance(kept, Message)
    assert json.loads(kept.entry["MessageAttributes"]["outbox-headers"]["StringValue"]) == {"x": "a\x01\ufffe"}


def test_group_ids() -> None:
    assert group_id("order-1") == "order-1"
    for key in ("Zürich", "a b", "x" * 129):
        gid = group_id(key)
        assert gid.startswith("sha256:") and len(gid) <= 128 and gid == group_id(key)


# -- queues ---------------------------------------------------------------------------------------


def test_queue_names_by_the_prefix_rule_and_the_map() -> None:
    looked_up: list[str] = []

    def lookup(name: str) -> str:
        looked_up.append(name)
        return f"https://sqs.eu-west-1.amazonaws.com/1/{name}"

    queues = Queues("app-", {"audit.v1": QUEUE}, "orders", lookup)
    first = queues.of("orders")
    assert not isinstance(first, GiveUp) and first.name == "app-orders.fifo" and first.fifo
    assert queues.of(None) == first, "no topic: the default topic"
    assert queues.of("orders") == first and looked_up == ["app-orders.fifo"], "the URL is asked for once"
    mapped = queues.of("audit.v1")
    assert not isinstance(mapped, GiveUp) and mapped.url == QUEUE
    dotted = queues.of("billing.v2")
    assert isinstance(dotted, GiveUp) and "--sqs-queue-urls" in dotted.reason
    assert isinstance(queues.of("x" * 80), GiveUp)
    queues.forget_url(first.url)
    queues.of("orders")
    assert looked_up == ["app-orders.fifo"] * 2, "a queue SQS said is gone is looked up again"
    no_default = Queues("", {}, None, lookup).of(None)
    assert isinstance(no_default, GiveUp) and "--default-topic" in no_default.reason


# -- answers --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("code", "status", "sender", "answer"), [
    ("AWS.SimpleQueueService.NonExistentQueue", 400, True, SinkUnavailable),
    ("AccessDenied", 403, True, SinkUnavailable),
    ("KmsAccessDenied", 0, True, SinkUnavailable),
    ("RequestThrottled", 403, True, SinkUnavailable),
    ("InternalError", 0, False, SinkUnavailable),
    ("SomethingNew", 503, False, SinkUnavailable),
    ("InvalidMessageContents", 0, True, GiveUp),
    ("InvalidParameterValue", 400, True, GiveUp),
    ("SomethingNew", 0, True, GiveUp),  # a batch entry the sender got wrong
    ("SomethingNew", 400, True, Retry),
    ("403", 403, True, SinkUnavailable),  # an error body the client could not parse
])
def test_what_an_sqs_error_means(code: str, status: int, sender: bool, answer: type) -> None:
    assert isinstance(of_error({code}, "msg", status, "send to q", sender, 1.0), answer)


# -- a wave's requests ----------------------------------------------------------------------------


class Client:
    """A boto3 SQS client's two sends, answering from ``answer(entry)`` (None: sent) and noting each request."""

    def __init__(self, answer: Any = lambda entry: None) -> None:
        self.answer = answer
        self.requests: list[list[str]] = []

    def send_message(self, QueueUrl: str, **entry: Any) -> dict[str, Any]:
        return self.send_message_batch(QueueUrl, [{"Id": "0", **entry}])

    def send_message_batch(self, QueueUrl: str, Entries: list[dict[str, Any]]) -> dict[str, Any]:
        self.requests.append([e["MessageBody"] for e in Entries])
        failed = [{"Id": e["Id"], "Code": code, "Message": "no", "SenderFault": True}
                  for e in Entries if (code := self.answer(e)) is not None]
        return {"Successful": [{"Id": e["Id"]} for e in Entries if self.answer(e) is None], "Failed": failed}

    def close(self) -> None:
        pass


def test_a_waves_messages_share_requests_of_ten_and_each_gets_its_own_answer() -> None:
    client = Client(lambda entry: "InvalidMessageContents" if entry["MessageBody"] == '"bad"' else None)
    sink = SqsSink("https://sqs.eu-west-1.amazonaws.com", queue_urls={"orders": QUEUE}, client=client)
    events = [event(key=f"k{i}", payload_json=json.dumps("bad" if i == 3 else i)) for i in range(13)]
    answers = sink.deliver_many(events)
    assert [len(r) for r in client.requests] == [10, 3]
    assert [type(a).__name__ for a in answers] == ["Delivered"] * 3 + ["GiveUp"] + ["Delivered"] * 9


def test_a_request_stays_within_the_byte_limit() -> None:
    line = [(i, Message({}, 60)) for i in range(5)] + [(5, Message({}, 500))]
    cut = list(requests(line, 10, max_bytes=100))
    assert [[i for i, _ in r] for r in cut] == [[0], [1], [2], [3], [4], [5]], "a larger message goes alone"
    assert [[i for i, _ in r] for r in requests(line[:5], 2, max_bytes=1000)] == [[0, 1], [2, 3], [4]]
