"""The park's reads (store.fetch_parked) look the oldest parked event up once per PARKED_FLOOR_SECONDS, not
at every pass, for the partition floor of their event lookup; what they return is unchanged: an event
parked after the floor was looked up, older than it, comes back in the very next pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outbox_relay import history, store
from tests.integration.relay_helpers import SINK, register

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

BUCKETS = list(range(256))


@pytest.fixture(autouse=True)
def fresh_floors(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(store, "_parked_floors", {}, raising=False)
    yield


@pytest.fixture(name="lookups")
def lookups_fixture(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The oldest_parked lookups made (the statement the floor's cache saves)."""
    made: list[str] = []
    real = store.query

    def counting(file: str, name: str) -> str:
        if name == "oldest_parked":
            made.append(name)
        return real(file, name)

    monkeypatch.setattr(store, "query", counting)
    return made


def publish(conn: psycopg.Connection[Any], key: str) -> Any:
    row = conn.execute("INSERT INTO outbox.events (partition_key, type, payload) VALUES (%s, 't', '{}') "
                       "RETURNING id", (key,)).fetchone()
    assert row is not None
    return row[0]


def park(conn: psycopg.Connection[Any], event_id: Any) -> None:
    """Park an event due now, as the relay parks a failed head."""
    conn.execute("INSERT INTO outbox.parked (sink, bucket, xid, seq, partition_key, event_id) "
                 "SELECT %s, bucket, xid, seq, partition_key, id FROM outbox.events WHERE id = %s", (SINK, event_id))


def test_the_oldest_parked_event_is_looked_up_once_per_interval(dsn: str, lookups: list[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    register(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        parked = {publish(conn, f"key-{i}") for i in range(5)}
        for event_id in parked:
            park(conn, event_id)
        for _ in range(5):
            assert {e.id for e in store.fetch_parked(conn, SINK, BUCKETS, 100, 10)} == parked
        assert len(lookups) == 1, "one lookup for five passes"
        monkeypatch.setattr(store, "PARKED_FLOOR_SECONDS", 0.0, raising=False)
        store.fetch_parked(conn, SINK, BUCKETS, 100, 10)
        assert len(lookups) == 2, "looked up again once the interval passed"


def test_an_event_parked_below_the_floor_is_retried_in_the_next_pass(dsn: str, lookups: list[str]) -> None:
    """An operator's retry parks an old event (here in an older xid range than every event parked so far):
    the floor in the cache is above it, and the pass still returns it (reading again with a fresh floor)."""
    register(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        old = publish(conn, "old-key")
        history.roll(conn, 86400.0, min_width=1000)  # a new xid range from here on
        new = publish(conn, "new-key")
        park(conn, new)
        assert [e.id for e in store.fetch_parked(conn, SINK, BUCKETS, 100, 10)] == [new]
        park(conn, old)
        assert {e.id for e in store.fetch_parked(conn, SINK, BUCKETS, 100, 10)} == {old, new}
        assert len(lookups) == 2, "the cached floor, then a fresh one"
        assert {e.id for e in store.fetch_parked(conn, SINK, BUCKETS, 100, 10)} == {old, new}
        assert len(lookups) == 2, "the fresh floor is cached"
