"""A dropped sink stays dropped: relays that still run it stop loudly, and none registers it again by
itself (which would re-apply all retained history to it)."""

from __future__ import annotations

import threading

import psycopg
import pytest

from outbox_relay import store
from outbox_relay.errors import SinkDropped
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import SINK, RecordingSink, fetch_all, make_settings, publish, register
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


def drop(dsn: str, sink: str = SINK) -> None:
    """What ``outbox-relay sinks drop --force`` leaves: a tombstone, no cursors, parked or dead letters."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        for table in ("cursors", "parked", "dead_letters"):
            conn.execute(f"DELETE FROM outbox.{table} WHERE sink = %s", (sink,))  # fixed table names
        conn.execute("UPDATE outbox.sinks SET dropped_at = clock_timestamp() WHERE name = %s", (sink,))


def test_a_dropped_sink_is_not_registered_again(dsn: str) -> None:
    register(dsn)
    drop(dsn)
    with (psycopg.connect(dsn, autocommit=True) as conn,
          pytest.raises(SinkDropped, match=rf"sink '{SINK}' was dropped at .*sinks recreate {SINK}")):
        store.register_sink(conn, SINK, "projection")
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.cursors WHERE sink = %s", (SINK,)) == [(0,)]


def test_a_relay_whose_sink_is_dropped_stops_instead_of_idling(dsn: str) -> None:
    publish(dsn, [(f"k{i}", "t", {}) for i in range(20)])
    sink = RecordingSink("w")
    worker = Worker(make_settings(dsn, "w"), sinks=[sink])
    assert worker.start()
    waiter = threading.Thread(target=worker.wait)
    waiter.start()
    try:
        wait_until(lambda: len(sink.delivered_ids()) == 20, timeout=15, message="the first events delivered")
        drop(dsn)
        waiter.join(20)
        assert not waiter.is_alive(), "the worker idled on a dropped sink instead of stopping"
    finally:
        worker.stop_hard()
        waiter.join(10)
    assert isinstance(worker.fatal, SinkDropped)
    assert "sinks drop" in str(worker.fatal)
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.cursors WHERE sink = %s", (SINK,)) == [(0,)], \
        "nothing recreated the dropped sink's cursors"


def test_a_relay_does_not_start_on_a_dropped_sink(dsn: str) -> None:
    register(dsn)
    drop(dsn)
    worker = Worker(make_settings(dsn, "w"), sinks=[RecordingSink("w")])
    try:
        with pytest.raises(SinkDropped):
            worker.start()
    finally:
        if worker.pool is not None:
            worker.pool.close()
