"""The Redis sink's entry and stream (no server): the fields, the names, the faults of an event, and
which server errors hold the sink."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest

from outbox_relay.errors import ConfigurationError
from outbox_relay.sinks import GiveUp, SinkEvent
from outbox_relay.sinks.redis import entry, stream_of
from outbox_relay.sinks.redis.connection import check_url, condition


def event(**changes: object) -> SinkEvent:
    values: dict[str, object] = {
        "id": uuid.UUID("01a23765-f53a-7790-a34e-263355335478"), "topic": "orders", "key": "order:1",
        "type": "OrderPlaced", "payload_json": '{"a": 1}', "headers": {"trace": "t"},
        "time": datetime(2026, 12, 2, 16, 0, tzinfo=timezone(timedelta(hours=2))), "version": 1, "attempt": 1}
    values.update(changes)
    return SinkEvent(**values)  # type: ignore[arg-type]


def test_the_entry_holds_the_cloudevents_attributes_the_payload_and_prefixed_headers() -> None:
    fields = entry(event(), "shop")
    assert fields == {b"specversion": b"1.0", b"id": b"01a23765-f53a-7790-a34e-263355335478", b"source": b"shop",
                      b"type": b"OrderPlaced", b"time": b"2026-12-02T14:00:00Z", b"subject": b"order:1",
                      b"datacontenttype": b"application/json", b"data": b'{"a": 1}', b"header.trace": b"t"}
    # A header named like an attribute can not replace it.
    clash = entry(event(headers={"id": "forged", "data": "x"}), "shop")
    assert not isinstance(clash, GiveUp)
    assert clash[b"id"] == b"01a23765-f53a-7790-a34e-263355335478" and clash[b"header.id"] == b"forged"


def test_an_event_that_can_not_be_an_entry_is_given_up_with_the_reason() -> None:
    too_big = entry(event(payload_json='"' + "x" * 300 + '"'), "shop", max_bytes=200)
    assert isinstance(too_big, GiveUp) and "over the Redis sink's limit of 200" in too_big.reason
    bad = entry(event(headers={"h": "\ud800"}), "shop")
    assert isinstance(bad, GiveUp) and "UTF-8" in bad.reason


def test_the_stream_is_the_prefix_and_the_topic_or_the_default_topic() -> None:
    assert stream_of("app:", "orders", None) == "app:orders"
    assert stream_of("", None, "misc") == "misc"
    none = stream_of("app:", None, None)
    assert isinstance(none, GiveUp) and "no topic" in none.reason
    bad = stream_of("app:", "no spaces", None)
    assert isinstance(bad, GiveUp) and "not a topic name" in bad.reason


@pytest.mark.parametrize(("url", "problem"), [
    ("http://h:6379", "must start with redis://"),
    ("redis://", "no host"),
    ("redis://h:6379/zero", "database number"),
    ("redis://h:99999", "not a URL"),
    ("redis://h:6379/0#x", "fragment"),
])
def test_bad_urls_are_refused_without_quoting_them(url: str, problem: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        check_url(url.replace("h:", ":pw-Hidden-7@h:", 1) if "//h" in url else url)
    assert problem in str(caught.value) and "pw-Hidden-7" not in str(caught.value)


def test_the_endpoint_shows_no_credentials() -> None:
    target = check_url("rediss://user:p%40ss-Word@cache.example:6380/3")
    assert target.endpoint == "rediss://cache.example:6380/3" and target.tls and target.password == "p@ss-Word"


def test_server_errors_that_are_conditions_of_the_sink() -> None:
    import redis

    for exc in (redis.exceptions.ConnectionError("refused"), redis.exceptions.TimeoutError("slow"),
                redis.exceptions.AuthenticationError("invalid username-password pair", status_code="WRONGPASS"),
                redis.exceptions.OutOfMemoryError("command not allowed", status_code="OOM"),
                redis.exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
                redis.exceptions.ReadOnlyError("You can't write against a read only replica.", status_code="READONLY"),
                redis.exceptions.ResponseError("unknown command 'XADD'", status_code="ERR")):
        assert condition(exc) is not None, exc
    assert condition(redis.exceptions.ResponseError("ERR something about this entry")) is None
    assert condition(ValueError("not redis")) is None
