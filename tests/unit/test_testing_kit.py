"""The testing kit without a database: FakeOutbox's own behaviour and the assertion messages.

What FakeOutbox shares with Outbox (validation, idempotency) is checked against PostgreSQL in
tests/integration/test_outbox_contract.py.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any
from unittest.mock import ANY

import pytest

from outbox_relay import IdempotencyConflict, Outbox, Published
from outbox_relay.testing import (
    FakeOutbox,
    PublishedEvent,
    assert_not_published,
    assert_published,
    published,
)
from outbox_relay.testing.fake import _canonical


def test_a_fake_outbox_is_an_outbox_that_records_in_publish_order() -> None:
    fake = FakeOutbox(default_topic="orders")
    assert isinstance(fake, Outbox)  # code typed against Outbox takes it
    a = fake.publish(None, type="A", key="k1", payload={"n": 1})
    b, c = fake.publish_many(object(), [{"type": "B", "key": "k2", "payload": (1, 2)},
                                        {"type": "C", "key": "k1", "payload": None, "topic": "billing"}])
    d = asyncio.run(fake.apublish("any connection", type="D", key="k1", payload="x"))
    events = fake.events
    assert [(e.id, e.type, e.key, e.topic, e.payload, e.position) for e in events] == [
        (a.id, "A", "k1", "orders", {"n": 1}, (0, 1)),
        (b.id, "B", "k2", "orders", [1, 2], (0, 2)),
        (c.id, "C", "k1", "billing", None, (0, 3)),
        (d.id, "D", "k1", "orders", "x", (0, 4)),
    ]
    events.clear()  # a copy
    assert [e.type for e in published(fake, key="k1")] == ["A", "C", "D"]
    assert [e.type for e in published(fake, topic="billing")] == ["C"]


def test_a_refused_call_records_nothing_and_clear_forgets_everything() -> None:
    fake = FakeOutbox(default_topic="orders")
    first = fake.publish(None, type="A", key="k", payload=1, idempotency_key="i")
    with pytest.raises(IdempotencyConflict):
        fake.publish_many(None, [{"type": "B", "key": "k", "payload": 2},
                                 {"type": "A", "key": "k", "payload": 2, "idempotency_key": "i"}])
    assert [e.type for e in fake.events] == ["A"]
    fake.clear()
    assert fake.events == []
    again = fake.publish(None, type="A", key="k", payload=2, idempotency_key="i")  # the key is free again
    assert again.created and again.id != first.id
    assert fake.publish(None, type="A", key="k", payload=2, idempotency_key="i") == Published(again.id, False)


@pytest.mark.parametrize(("a", "b", "same"), [
    ({"a": 1, "b": 2}, {"b": 2, "a": 1}, True),
    ({"n": 1}, {"n": 1.0}, False),
    ({"n": 1.5e1}, {"n": 15.0}, True),
    ({"n": 1e16}, {"n": 10**16}, True),
    ({"n": -0.0}, {"n": 0.0}, True),
    ({"n": 0}, {"n": 0.0}, False),
    ([1, [2]], [1, [2]], True),
    ([1, 2], [2, 1], False),
    ({"x": True}, {"x": 1}, False),
    ({"x": None}, {}, False),
    ("1", 1, False),
])
def test_payloads_compare_as_jsonb_text_does(a: Any, b: Any, same: bool) -> None:
    assert (_canonical(json.dumps(a)) == _canonical(json.dumps(b))) is same


def event(type: str, key: str = "k", payload: Any = None, n: int = 1, **fields: Any) -> PublishedEvent:
    values: dict[str, Any] = {"id": uuid.UUID(int=n), "type": type, "key": key, "topic": "orders",
                              "payload": payload, "headers": {}, "idempotency_key": None, "time": None,
                              "position": (0, n)}
    values.update(fields)
    return PublishedEvent(**values)


def test_a_list_of_events_is_read_in_position_order() -> None:
    later, earlier = event("B", n=2), event("A", n=1)
    assert [e.type for e in published([later, earlier])] == ["A", "B"]
    assert_published([later, earlier], ["A", "B"])
    assert_published((later,), [{"id": uuid.UUID(int=2)}])


def test_a_mismatch_shows_what_was_expected_against_what_was_published() -> None:
    events = [event("A", payload={"b": [1], "a": "x"}, n=1), event("B", payload=None, n=2)]
    with pytest.raises(AssertionError) as caught:
        assert_published(events, [("A", {"a": ANY, "b": [2]}), {"type": "B", "headers": {"h": "v"}}], key="k")
    assert str(caught.value).splitlines() == [
        "assert_published: the events with key='k' are not the expected ones (2 expected, 2 published), in "
        "position order:",
        '  1 DIFFERS    expected:  A {"a": "<ANY>", "b": [2]}',
        '               published: A {"a": "x", "b": [1]}   (payload differs)',
        '  2 DIFFERS    expected:  B headers={"h": "v"}',
        '               published: B null headers={}   (headers differs)',
    ]


def test_long_lists_and_payloads_are_cut_short() -> None:
    events = [event("A", payload={"text": "x" * 1000}, n=i) for i in range(1, 31)]
    with pytest.raises(AssertionError) as caught:
        assert_published(events, [])
    lines = str(caught.value).splitlines()
    assert len(lines) == 22 and lines[-1] == "  ... and 10 more"
    assert lines[1].startswith("  1 UNEXPECTED published: A {\"text\": \"xxx") and "...\" key=" not in lines[1]
    assert len(lines[1]) < 420
    with pytest.raises(AssertionError) as caught:
        assert_not_published(events, type="A")
    assert str(caught.value).splitlines()[-1] == "  ... and 10 more"


def test_a_source_that_is_not_one_is_named() -> None:
    with pytest.raises(TypeError, match=r"cannot read events from a int"):
        published(42)
    with pytest.raises(TypeError, match=r"cannot read events from a list"):
        published(["not an event"])


def test_docs_testing_md_names_every_public_name_of_the_kit() -> None:
    from pathlib import Path

    import outbox_relay.testing as kit

    doc = (Path(__file__).resolve().parents[2] / "docs" / "testing.md").read_text()
    assert [name for name in kit.__all__ if f"`{name}" not in doc] == []
