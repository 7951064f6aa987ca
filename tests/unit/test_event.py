"""The event envelope: uuid7 ids and validation that names the field."""

from __future__ import annotations

import inspect
import math
import re
import time
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from outbox_relay import IdempotencyConflict, errors, event
from outbox_relay.errors import InvalidEvent, OutboxError
from outbox_relay.event import (
    MAX_KEY_BYTES,
    MAX_PAYLOAD_DEPTH,
    RESERVED_HEADER_PREFIX,
    RESERVED_HEADERS,
    Event,
    make_event,
    uuid7,
)
from outbox_relay.publish import Outbox


def test_uuid7_version_variant_and_timestamp() -> None:
    before = time.time_ns() // 1_000_000
    u = uuid7()
    after = time.time_ns() // 1_000_000
    assert u.version == 7
    assert u.variant == uuid.RFC_4122
    assert before <= u.int >> 80 <= after  # the top 48 bits are the Unix time in milliseconds


def test_uuid7_orders_by_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(1_700_000_000_000_000_000, 1_700_000_000_100_000_000, 1_000_000))  # +1 ms per call
    monkeypatch.setattr(event.time, "time_ns", lambda: next(clock))
    ids = [uuid7() for _ in range(100)]
    assert ids == sorted(ids)
    assert len({u.int >> 80 for u in ids}) == 100


def test_uuid7_random_part_differs_within_a_millisecond(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(event.time, "time_ns", lambda: 1_700_000_000_000_000_000)
    ids = {uuid7() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 for u in ids)


def test_events_get_distinct_ids_by_default() -> None:
    a, b = (make_event(type="t", key="k", payload=None) for _ in range(2))
    assert a.id != b.id and a.id.version == 7


@pytest.mark.parametrize(("fields", "named"), [
    ({"type": ""}, "type"),
    ({"type": "x" * 256}, "type"),
    ({"key": ""}, "key"),
    ({"key": "é" * (MAX_KEY_BYTES // 2 + 1)}, "key"),
    ({"key": 42}, "key"),
    ({"topic": "no spaces"}, "topic"),
    ({"topic": "x" * 250}, "topic"),
    ({"topic": "."}, "topic"),
    ({"topic": ".."}, "topic"),
    ({"topic": "orders\n"}, "topic"),
    ({"headers": {"h": 1}}, "headers.h"),
    ({"headers": {"h": b"bytes"}}, "headers.h"),
    ({"headers": {"ce_id": "x"}}, "headers"),
    ({"idempotency_key": ""}, "idempotency_key"),
    ({"idempotency_key": "k" * 513}, "idempotency_key"),
    ({"id": "not-a-uuid"}, "id"),
    ({"time": "yesterday"}, "time"),
    ({"time": datetime(2026, 1, 1)}, "time"),  # naive: the database would read it in its session's zone
    ({"color": "red"}, "color"),
])
def test_validation_names_the_field(fields: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidEvent) as info:
        make_event(**{"type": "t", "key": "k", "payload": {}, **fields})
    assert f"{named}:" in str(info.value)


def test_missing_required_fields_are_named() -> None:
    with pytest.raises(InvalidEvent) as info:
        make_event(payload={})
    assert "type:" in str(info.value) and "key:" in str(info.value)


def test_key_limit_counts_bytes() -> None:
    assert make_event(type="t", key="é" * (MAX_KEY_BYTES // 2), payload=0).key  # exactly 1024 bytes
    assert make_event(type="t", key="k" * MAX_KEY_BYTES, payload=0).key
    with pytest.raises(InvalidEvent, match="1025 bytes"):
        make_event(type="t", key="k" * (MAX_KEY_BYTES + 1), payload=0)


@pytest.mark.parametrize("payload", [{"tags": {1, 2}}, {"x": math.nan}, [math.inf], {"when": object()}])
def test_payload_must_be_json(payload: object) -> None:
    e = make_event(type="order.placed", key="order-7", payload=payload)
    with pytest.raises(InvalidEvent, match="payload") as info:
        e.payload_json()
    assert "order-7" in str(info.value)


def test_payload_json_is_compact_and_keeps_unicode() -> None:
    e = make_event(type="t", key="k", payload={"name": "Zoë", "n": [1, 2]})
    assert e.payload_json() == '{"name":"Zoë","n":[1,2]}'


def test_outbox_requires_a_topic() -> None:
    with pytest.raises(InvalidEvent, match="topic"):
        Outbox().event(type="t", key="k", payload={})
    assert Outbox(default_topic="orders").event(type="t", key="k", payload={}).topic == "orders"
    assert Outbox(default_topic="orders").event(type="t", key="k", payload={}, topic="audit").topic == "audit"


def test_events_are_immutable() -> None:
    e = make_event(type="t", key="k", payload={})
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen error type is an implementation detail
        e.key = "other"  # type: ignore[misc]
    assert isinstance(e, Event)


def test_invalid_event_is_a_value_error_and_an_outbox_error() -> None:
    assert issubclass(InvalidEvent, ValueError) and issubclass(InvalidEvent, OutboxError)
    assert all(issubclass(getattr(errors, name), OutboxError)
               for name in dir(errors) if name[0].isupper() and isinstance(getattr(errors, name), type)
               and issubclass(getattr(errors, name), Exception))


def test_topic_names_kafka_accepts() -> None:
    for topic in ("orders", "a.b_c-D9", "...", "x" * 249):
        assert make_event(type="t", key="k", payload=0, topic=topic).topic == topic


def _nested(depth: int) -> Any:
    payload: Any = 0
    for level in range(depth):
        payload = [payload] if level % 2 else {"n": payload}
    return payload


def test_payload_depth_limit() -> None:
    deepest = make_event(type="t", key="k", payload=_nested(MAX_PAYLOAD_DEPTH))
    assert deepest.payload_json().count("[") + deepest.payload_json().count("{") == MAX_PAYLOAD_DEPTH
    wide = make_event(type="t", key="k", payload=[_nested(MAX_PAYLOAD_DEPTH - 1)] * 100 + [(1, 2)])
    assert wide.payload_json()
    with pytest.raises(InvalidEvent, match=f"payload: .*more than {MAX_PAYLOAD_DEPTH} levels"):
        make_event(type="t", key="k", payload=_nested(MAX_PAYLOAD_DEPTH + 1))
    with pytest.raises(InvalidEvent, match="payload"):  # tuples serialise as arrays: they count
        make_event(type="t", key="k", payload=[[1], ((_nested(MAX_PAYLOAD_DEPTH - 2),),), "x"])


@pytest.mark.parametrize("depth", [990, 10_000, 200_000])
def test_any_depth_is_refused_without_recursion(depth: int) -> None:
    with pytest.raises(InvalidEvent, match="payload"):  # not RecursionError
        make_event(type="t", key="k", payload=_nested(depth))


def test_a_payload_that_contains_itself_is_refused() -> None:
    loop: list[Any] = []
    loop.append({"again": loop})
    with pytest.raises(InvalidEvent, match="contains itself"):
        make_event(type="t", key="k", payload={"loop": loop})


def test_payload_json_never_raises_recursion_error() -> None:
    unchecked = Event.model_construct(type="t", key="k", payload=_nested(10_000))  # skips validation
    with pytest.raises(InvalidEvent, match="levels deep"):
        unchecked.payload_json()


@pytest.mark.parametrize("name", [
    *sorted(RESERVED_HEADERS), "CE_ID", "Ce_Type", "CONTENT-TYPE", "outbox_fence", "outbox_replay",
    "OUTBOX_FENCE", "Outbox_anything", RESERVED_HEADER_PREFIX, "ce_\u0130d",
    # lookalikes: '-' for '_', spaces, zero-width and soft-hyphen characters, fullwidth letters
    "content_type", "outbox-fence", "CE-ID", "ce_id ", "ce_\u200bid", "c\u00ade_id", "\uff43\uff45\uff3f\uff49\uff44",
])
def test_reserved_header_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidEvent, match=f"headers: .*{re.escape(repr(name))} is reserved"):
        make_event(type="t", key="k", payload=0, headers={"trace": "1", name: "x"})


@pytest.mark.parametrize("name", ["ce_other", "cex_id", "content_length", "outbox", "my_outbox_fence", "trace",
                                  "ce_idx", "traceparent"])
def test_other_header_names_are_fine(name: str) -> None:
    assert make_event(type="t", key="k", payload=0, headers={name: "x"}).headers == {name: "x"}


def test_time_is_aware() -> None:
    when = datetime(1970, 1, 1, tzinfo=timezone(timedelta(hours=2)))
    assert make_event(type="t", key="k", payload=0, time=when).time == when
    assert make_event(type="t", key="k", payload=0, time="2026-01-01T00:00:00Z").time == datetime(2026, 1, 1,
                                                                                                  tzinfo=UTC)


PUBLISH_PARAMETERS = ["conn", "type", "key", "payload", "topic", "headers", "idempotency_key", "time", "id",
                      "version"]


@pytest.mark.parametrize("method", [Outbox.publish, Outbox.apublish])
def test_publish_has_typed_keyword_parameters(method: Any) -> None:
    signature = inspect.signature(method)
    assert list(signature.parameters)[1:] == PUBLISH_PARAMETERS
    for name in PUBLISH_PARAMETERS[1:]:
        parameter = signature.parameters[name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
        assert parameter.annotation != "Any" or name == "payload"
    assert [p for p in signature.parameters.values() if p.default is inspect.Parameter.empty][1:] == [
        signature.parameters[name] for name in ("conn", "type", "key", "payload")]
    assert signature.return_annotation == "Published"


def test_idempotency_conflict_is_an_invalid_event() -> None:
    exc = IdempotencyConflict("k-1", None, "stands for another event")
    assert isinstance(exc, InvalidEvent) and (exc.idempotency_key, exc.topic) == ("k-1", None)
    assert str(exc) == "idempotency key 'k-1' of events without a topic stands for another event"


# Values that reach publish's quick check (event.plain_fields_valid): each must either be judged "not
# sure" or pass Event unchanged, so that the model never has to be built for them.
QUICK_CASES: list[dict[str, Any]] = [
    {}, {"type": ""}, {"type": "x" * 255}, {"type": "x" * 256}, {"type": b"t"}, {"key": ""}, {"key": "k" * 1024},
    {"key": "k" * 1025}, {"key": "é" * 512}, {"key": "é" * 513}, {"key": "\ud800"}, {"key": 1}, {"topic": "."},
    {"topic": ".."}, {"topic": "orders\n"}, {"topic": "a" * 249}, {"topic": "a" * 250}, {"topic": "or ders"},
    {"idempotency_key": ""}, {"idempotency_key": "i" * 512}, {"idempotency_key": "i" * 513},
    {"idempotency_key": 5}, {"version": 0}, {"version": 32767}, {"version": 32768}, {"version": True},
    {"version": "2"}, {"version": 2.0}, {"time": datetime(2026, 1, 1)}, {"time": datetime(2026, 1, 1, tzinfo=UTC)},
    {"time": "2026-01-01T00:00:00Z"}, {"payload": {"a": [1, {"b": None}]}},
    {"payload": "x"}, {"payload": [[[]]]},
]


@pytest.mark.parametrize("change", QUICK_CASES, ids=repr)
def test_the_quick_check_only_passes_what_event_keeps_as_given(change: dict[str, Any]) -> None:
    fields: dict[str, Any] = {"type": "t", "key": "k", "payload": {}, "topic": "orders", "idempotency_key": None,
                              "time": None, "version": 1, **change}
    if not event.plain_fields_valid(**fields):
        return
    built = make_event(**fields)
    for name, value in fields.items():
        kept = getattr(built, name)
        assert kept is value or (kept == value and type(kept) is type(value)), name


def test_the_quick_check_refuses_what_event_refuses() -> None:
    nested: Any = []
    for _ in range(MAX_PAYLOAD_DEPTH):
        nested = [nested]
    assert not event.plain_fields_valid("t", "k", nested, "orders", None, None, 1)
    assert event.plain_fields_valid("t", "k", nested[0], "orders", None, None, 1)
    assert not event.plain_fields_valid("", "k", {}, "orders", None, None, 1)
    assert event.plain_fields_valid("t", "k", {}, "orders", "i", datetime(2026, 1, 1, tzinfo=UTC), 2)


@pytest.mark.parametrize("bad", [
    {"type": ""}, {"key": ""}, {"key": "é" * 513}, {"key": "a\x00b"}, {"type": "a\x00"}, {"topic": ".."},
    {"payload": {"x": math.nan}}, {"payload": {"s": {1}}}, {"payload": "a\x00"}, {"payload": "\ud800"},
    {"idempotency_key": ""}, {"idempotency_key": "a\x00"}, {"version": 0}, {"time": datetime(2026, 1, 1)},
    {"headers": {"ce_id": "x"}}, {"time": datetime.min.replace(tzinfo=UTC)}, {"time": datetime.max.replace(tzinfo=UTC)},
], ids=repr)
def test_publish_refuses_as_publish_many_does(bad: dict[str, Any]) -> None:
    """publish's quick path (no Event built) names the problem in the words of the general path."""
    outbox = Outbox(default_topic="orders")
    fields: dict[str, Any] = {"type": "t", "key": "k", "payload": {}, **bad}
    with pytest.raises(InvalidEvent) as quick:
        outbox.publish(object(), **fields)
    with pytest.raises(InvalidEvent) as quick_many:  # publish_many's quick path for plain dicts
        outbox.publish_many(object(), [{"type": "t", "key": "k", "payload": 1}, fields])
    with pytest.raises(InvalidEvent) as general:  # headers: an Event is built for each dict
        outbox.publish_many(object(), [{"headers": {}, **fields}])
    assert str(quick.value) == str(quick_many.value) == str(general.value)


def test_random_bits_are_not_reused_across_buffer_refills() -> None:
    ids = {uuid7().int & (2**62 - 1) for _ in range(1000)}  # 1000 ids span several 128-id buffers
    assert len(ids) == 1000
