"""Contract tests: FakeOutbox (outbox_relay.testing) behaves as Outbox on a real PostgreSQL.

Every scenario runs against four sides: ``Outbox`` on PostgreSQL through ``publish`` /
``publish_many`` (each call its own committed transaction) and through ``apublish`` /
``apublish_many`` on an AsyncConnection, and ``FakeOutbox`` through both. All four must pass; a
change to what Outbox accepts or how it answers that the fake does not follow fails here. The last
tests run the same script on the database and on the fake and compare every answer and error
message.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any, Protocol

import psycopg
import pytest

from outbox_relay import Event, IdempotencyConflict, InvalidEvent, Outbox, Published
from outbox_relay.event import MAX_KEY_BYTES, MAX_PAYLOAD_DEPTH
from outbox_relay.testing import FakeOutbox, PublishedEvent, published

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

TOPIC = "orders"
CONFLICT = ("already stands for another event, stored or in this batch (type, key or payload differ): a retry must "
            "publish the same event, a new event needs a new key; nothing of this call was written")


class Side(Protocol):
    outbox: Outbox

    def publish(self, **fields: Any) -> Published: ...

    def publish_many(self, events: list[Event | dict[str, Any]]) -> list[Published]: ...

    def events(self, **filters: Any) -> list[PublishedEvent]: ...


class Database:
    """Outbox on PostgreSQL: every call in a transaction of its own, committed unless it raised."""

    def __init__(self, dsn: str, outbox: Outbox, use_async: bool) -> None:
        self.dsn = dsn
        self.outbox = outbox
        self.use_async = use_async

    def publish(self, **fields: Any) -> Published:
        if self.use_async:
            return self._async(lambda conn: self.outbox.apublish(conn, **fields))  # type: ignore[no-any-return]
        with psycopg.connect(self.dsn) as conn:
            return self.outbox.publish(conn, **fields)

    def publish_many(self, events: list[Event | dict[str, Any]]) -> list[Published]:
        if self.use_async:
            return self._async(lambda conn: self.outbox.apublish_many(conn, events))  # type: ignore[no-any-return]
        with psycopg.connect(self.dsn) as conn:
            return self.outbox.publish_many(conn, events)

    def _async(self, call: Callable[[psycopg.AsyncConnection[Any]], Any]) -> Any:
        async def main() -> Any:
            async with await psycopg.AsyncConnection.connect(self.dsn) as conn:
                return await call(conn)

        return asyncio.run(main())

    def events(self, **filters: Any) -> list[PublishedEvent]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return published(conn, **filters)


class Fake:
    """FakeOutbox, called the way the code under test calls an Outbox (the connection is not used)."""

    def __init__(self, outbox: FakeOutbox, use_async: bool) -> None:
        self.outbox = outbox
        self.use_async = use_async

    def publish(self, **fields: Any) -> Published:
        if self.use_async:
            return asyncio.run(self.outbox.apublish(None, **fields))
        return self.outbox.publish(None, **fields)

    def publish_many(self, events: list[Event | dict[str, Any]]) -> list[Published]:
        if self.use_async:
            return asyncio.run(self.outbox.apublish_many(None, events))
        return self.outbox.publish_many(None, events)

    def events(self, **filters: Any) -> list[PublishedEvent]:
        return published(self.outbox, **filters)


SideFactory = Callable[..., Side]


@pytest.fixture(params=["postgres", "postgres-async", "fake", "fake-async"])
def side(request: pytest.FixtureRequest) -> Iterator[SideFactory]:
    """``side(default_topic=TOPIC)``: a fresh outbox of the parametrized kind."""
    kind: str = request.param

    def make(default_topic: str | None = TOPIC) -> Side:
        if kind.startswith("fake"):
            return Fake(FakeOutbox(default_topic), use_async=kind.endswith("async"))
        return Database(request.getfixturevalue("dsn"), Outbox(default_topic), use_async=kind.endswith("async"))

    yield make


def summary(events: list[PublishedEvent]) -> list[tuple[str, str, str | None, Any]]:
    return [(e.type, e.key, e.topic, e.payload) for e in events]


# -- the scenarios ------------------------------------------------------------------------------


def test_events_are_kept_per_key_in_publish_order_with_every_field(side: SideFactory) -> None:
    s = side()
    when = datetime(2026, 11, 1, 9, 30, tzinfo=UTC)
    a = s.publish(type="OrderPlaced", key="order:1", payload={"n": 1})
    s.publish(type="OrderPlaced", key="order:2", payload={"n": 2}, topic="billing")
    rest = s.publish_many([
        {"type": "OrderPaid", "key": "order:1", "payload": {"n": 3, "cents": 1.5}, "headers": {"trace": "t"},
         "idempotency_key": "paid-1", "time": when},
        Event(type="OrderShipped", key="order:1", payload=("a", None, True)),
        {"type": "OrderPaid", "key": "order:2", "payload": "text"},
    ])
    assert a.created and all(r.created for r in rest)
    assert summary(s.events(key="order:1")) == [
        ("OrderPlaced", "order:1", TOPIC, {"n": 1}),
        ("OrderPaid", "order:1", TOPIC, {"n": 3, "cents": 1.5}),
        ("OrderShipped", "order:1", TOPIC, ["a", None, True]),  # stored as JSON: a tuple comes back a list
    ]
    assert summary(s.events(key="order:2")) == [("OrderPlaced", "order:2", "billing", {"n": 2}),
                                                ("OrderPaid", "order:2", TOPIC, "text")]
    paid = s.events(type="OrderPaid", key="order:1")[0]
    assert (paid.id, paid.headers, paid.idempotency_key, paid.time) == (rest[0].id, {"trace": "t"}, "paid-1", when)
    assert [e.id for e in s.events(topic="billing")] == [s.events(key="order:2")[0].id]
    assert s.events(key="order:1")[0].id == a.id and s.events(key="order:1")[0].time is None


def test_a_repeated_idempotency_key_for_the_same_event_returns_the_first(side: SideFactory) -> None:
    s = side()
    first = s.publish(type="OrderPaid", key="order:1", payload={"b": 2, "a": [1, {"x": None}]}, idempotency_key="k")
    # Headers, time and id are not part of "the same event"; payload key order is not either.
    again = s.publish(type="OrderPaid", key="order:1", payload={"a": [1, {"x": None}], "b": 2}, idempotency_key="k",
                      headers={"retry": "1"}, time=datetime(2026, 1, 1, tzinfo=UTC), id=uuid.uuid4())
    batch = s.publish_many([{"type": "Other", "key": "order:1", "payload": 0},
                            {"type": "OrderPaid", "key": "order:1", "payload": {"a": [1, {"x": None}], "b": 2},
                             "idempotency_key": "k"}])
    assert first.created and again == Published(first.id, False)
    assert batch[0].created and batch[1] == Published(first.id, False)
    assert [e.type for e in s.events()] == ["OrderPaid", "Other"]
    assert s.events()[0].headers == {}


CHANGES: list[dict[str, Any]] = [
    {"type": "OrderRefunded"},
    {"key": "order:2"},
    {"payload": {"cents": 3001}},
    {"payload": {"cents": 3000.0}},  # jsonb keeps 3000 and 3000.0 apart
    {"payload": {"cents": "3000"}},
]


def test_another_event_under_a_known_key_is_refused_and_nothing_of_the_call_is_kept(side: SideFactory) -> None:
    s = side()
    original = {"type": "OrderPaid", "key": "order:1", "payload": {"cents": 3000}, "idempotency_key": "pay-1"}
    s.publish(**original)
    for change in CHANGES:
        with pytest.raises(IdempotencyConflict) as caught:
            s.publish_many([{"type": "Fine", "key": "order:3", "payload": {}}, {**original, **change}])
        assert str(caught.value) == f"idempotency key 'pay-1' of topic {TOPIC!r} {CONFLICT}", change
        assert (caught.value.idempotency_key, caught.value.topic) == ("pay-1", TOPIC)
    assert [e.type for e in s.events()] == ["OrderPaid"]


def test_payloads_are_compared_as_jsonb_compares_them(side: SideFactory) -> None:
    s = side()
    for key, stored, same, other in [
        ("a", {"n": 1e2}, {"n": 100.0}, {"n": 100}),      # 1e2 is stored as 100.0
        ("b", {"n": -0.0}, {"n": 0.0}, {"n": 0}),          # -0.0 as 0.0
        ("c", {"n": 1e-7}, {"n": 0.0000001}, {"n": 0.000001}),
        ("d", {"n": 10**20}, {"n": 1e20}, {"n": 10**20 + 1}),  # 1e20 is stored as 100000000000000000000
        ("e", [1, "1", True, None], [1, "1", True, None], [True, "1", 1, None]),
    ]:
        first = s.publish(type="T", key=key, payload=stored, idempotency_key=key)
        assert s.publish(type="T", key=key, payload=same, idempotency_key=key) == Published(first.id, False)
        with pytest.raises(IdempotencyConflict):
            s.publish(type="T", key=key, payload=other, idempotency_key=key)
    assert len(s.events()) == 5


def test_idempotency_keys_are_unique_per_topic(side: SideFactory) -> None:
    s = side()
    orders = s.publish(type="A", key="k", payload=1, idempotency_key="same")
    billing = s.publish(type="B", key="other", payload=2, idempotency_key="same", topic="billing")
    assert orders.created and billing.created and orders.id != billing.id
    with pytest.raises(IdempotencyConflict, match="of topic 'billing'"):
        s.publish(type="A", key="k", payload=1, idempotency_key="same", topic="billing")
    assert [(e.topic, e.type) for e in s.events()] == [(TOPIC, "A"), ("billing", "B")]


def test_one_key_twice_in_a_batch(side: SideFactory) -> None:
    s = side()
    same = s.publish_many([{"type": "A", "key": "k", "payload": 1, "idempotency_key": "x"},
                           {"type": "B", "key": "k", "payload": 2},
                           {"type": "A", "key": "k", "payload": 1, "idempotency_key": "x"}])
    assert same[0].created and same[1].created and same[2] == Published(same[0].id, False)
    with pytest.raises(IdempotencyConflict, match=r"idempotency key 'y' of topic 'orders' already stands"):
        s.publish_many([{"type": "C", "key": "k", "payload": 3},
                        {"type": "A", "key": "k", "payload": 1, "idempotency_key": "y"},
                        {"type": "A", "key": "k", "payload": 2, "idempotency_key": "y"}])
    assert [e.type for e in s.events()] == ["A", "B"]


def test_one_event_twice_in_a_batch_is_one_and_two_events_may_not_share_an_id(side: SideFactory) -> None:
    s = side()
    e = s.outbox.event(type="A", key="k", payload={"n": 1})
    results = s.publish_many([e, e])
    assert results == [Published(e.id, True), Published(e.id, False)]
    clash = s.outbox.event(type="B", key="k", payload={}, id=uuid.uuid4())
    other = Event(type="C", key="k", payload={}, topic=TOPIC, id=clash.id)
    with pytest.raises(InvalidEvent, match=rf"two different events in one batch have the id {clash.id}"):
        s.publish_many([clash, other])
    assert [x.type for x in s.events()] == ["A"]


def test_an_id_already_stored_is_refused_by_the_database_and_the_fake_alike(side: SideFactory) -> None:
    # Found by the publish statement, which then inserts nothing: the caller's transaction goes on
    # (it was aborted by the primary key's error before).
    s = side()
    first = s.publish(type="A", key="k", payload=1)
    with pytest.raises(InvalidEvent, match=rf"an event with the id {first.id} is already stored"):
        s.publish_many([{"type": "B", "key": "k", "payload": 2}, {"type": "A", "key": "k", "payload": 1,
                                                                  "id": first.id}])
    assert [x.type for x in s.events()] == ["A"]


def _deep(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("empty key", {"key": ""}, r"invalid event: key: Value error, must not be empty"),
    ("long key", {"key": "k" * (MAX_KEY_BYTES + 1)}, rf"key: Value error, is {MAX_KEY_BYTES + 1} bytes"),
    ("empty type", {"type": ""}, r"invalid event: type: String should have at least 1 character"),
    ("bad topic", {"topic": "no spaces"}, r"topic: Value error, 'no spaces' is not a Kafka topic name"),
    ("reserved header", {"headers": {"ce_id": "x"}}, r"'ce_id' is reserved for the relay"),
    ("header value", {"headers": {"h": 1}}, r"headers.h: Input should be a valid string"),
    ("set payload", {"payload": {1, 2}}, r"payload of 'T' event \(key 'k'\) is not JSON"),
    ("nan payload", {"payload": {"x": math.nan}}, r"is not JSON: Out of range float values"),
    ("object payload", {"payload": object()}, r"is not JSON: Object of type object"),
    ("NUL in payload", {"payload": "a\x00b"}, r"contains a NUL character"),
    ("NUL in key", {"key": "a\x00b"}, r"invalid event: key: contains a NUL character"),
    ("surrogate", {"payload": "\ud800"}, r"is not valid Unicode"),
    ("deep payload", {"payload": _deep(MAX_PAYLOAD_DEPTH + 1)}, rf"nested more than {MAX_PAYLOAD_DEPTH} levels"),
    ("naive time", {"time": datetime(2026, 1, 1)}, r"time: Input should have timezone info"),
    ("empty idempotency key", {"idempotency_key": ""}, r"idempotency_key: String should have at least 1"),
    ("unknown field", {"colour": "red"}, r"colour: Extra inputs are not permitted"),
]


def test_invalid_events_are_refused_naming_the_problem(side: SideFactory) -> None:
    s = side()
    for name, fields, message in INVALID:
        event = {"type": "T", "key": "k", "payload": {}, **fields}
        with pytest.raises(InvalidEvent, match=message):
            s.publish_many([{"type": "Fine", "key": "k", "payload": 1}, event])
        if name != "unknown field":  # publish() has no such keyword
            with pytest.raises(InvalidEvent, match=message):
                s.publish(**event)
    assert s.events() == []


def test_an_event_needs_a_topic_and_a_call_needs_an_event(side: SideFactory) -> None:
    s = side(default_topic=None)
    with pytest.raises(InvalidEvent, match=r"'T' event \(key 'k'\) has no topic and the Outbox has no default_topic"):
        s.publish(type="T", key="k", payload={})
    with pytest.raises(InvalidEvent, match=r"publish_many needs at least one event"):
        s.publish_many([])
    s.publish(type="T", key="k", payload={}, topic="explicit")
    assert [e.topic for e in s.events()] == ["explicit"]


# -- the same script on both, every answer compared --------------------------------------------


def script(s: Side) -> list[Any]:
    """A run of calls, good and bad; what each returned or raised (ids as first-seen indexes)."""
    ids: dict[uuid.UUID, int] = {}
    out: list[Any] = []
    fixed = uuid.UUID("01890a5d-ac96-774b-bcce-b302099a8057")
    calls: list[list[dict[str, Any]]] = [
        [{"type": "A", "key": "k1", "payload": {"x": 1}, "idempotency_key": "i1", "id": fixed}],
        [{"type": "A", "key": "k1", "payload": {"x": 1}, "idempotency_key": "i1"}],
        [{"type": "A", "key": "k1", "payload": {"x": 1.0}, "idempotency_key": "i1"}],
        [{"type": "B", "key": "k2", "payload": [], "idempotency_key": "i1", "topic": "other"},
         {"type": "B", "key": "k2", "payload": [], "idempotency_key": "i1", "topic": "other"},
         {"type": "C", "key": "k1", "payload": None}],
        [{"type": "D", "key": "k1", "payload": {"s": {1}}}],
        [{"type": "D", "key": "", "payload": {}}],
        [{"type": "D", "key": "k3", "payload": {}, "headers": {"Outbox_x": "1"}}],
        [{"type": "E", "key": "k3", "payload": {}, "idempotency_key": "i2"},
         {"type": "E", "key": "k3", "payload": {"v": 2}, "idempotency_key": "i2"}],
        [{"type": "F", "key": "k1", "payload": {}, "id": fixed}],
        [{"type": "G", "key": "k3", "payload": {"z": "\u2028é"}, "headers": {"h": ""}}],
    ]
    for call in calls:
        try:
            results = s.publish_many(call)  # type: ignore[arg-type]
        except Exception as exc:
            out.append((type(exc).__name__, str(exc)))
        else:
            out.append([(ids.setdefault(r.id, len(ids)), r.created) for r in results])
    out.append([(ids.get(e.id), e.type, e.key, e.topic, e.payload, e.headers, e.idempotency_key, e.time)
                for e in s.events()])
    return out


def test_the_fake_answers_as_the_database_does(dsn: str) -> None:
    database = script(Database(dsn, Outbox(default_topic=TOPIC), use_async=False))
    fake = script(Fake(FakeOutbox(default_topic=TOPIC), use_async=False))
    assert fake == database
    assert sum(isinstance(answer, tuple) for answer in database) == 6  # the errors are part of the script
