"""The delivery latency histogram measures the relay, not the application's transactions.

``outbox_relay_delivery_latency_seconds`` counts from when an event became visible to the relay (at
the latest from the last read of its bucket that did not see it yet), so a business transaction
that stays open for seconds before it commits does not show up as relay latency;
``outbox_relay_event_age_seconds`` keeps the age from the event's storing (its transaction's start).
Real PostgreSQL, the recording sink through the real runner.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry
from psycopg_pool import ConnectionPool

from outbox_relay.metrics import PrometheusObserver
from outbox_relay.publish import Outbox
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    SINK,
    TOPIC,
    RecordingSink,
    make_settings,
    pool_fixture,
    register,
    run_until,
    runner_for,
)

OPEN_SECONDS = 2.0  # how long the business transaction stays open after its publish


def test_a_long_business_transaction_is_age_not_delivery_latency(dsn: str, pool: ConnectionPool[Any]) -> None:
    register(dsn)
    sink = RecordingSink()
    runner = runner_for(sink, pool, make_settings(dsn, "relay-l"))
    registry = CollectorRegistry()
    runner.observer = PrometheusObserver(registry)
    run_until(runner, lambda: True)  # leases taken, cursors known

    with psycopg.connect(dsn) as conn:
        Outbox(default_topic=TOPIC).publish(conn, key="slow", type="t", payload={})
        opened = time.monotonic()
        time.sleep(OPEN_SECONDS)  # the application's slow transaction (set-up, not an assertion)
        before_last_read = time.monotonic()
        runner.run_once()  # a read that can not see the event yet
        assert not sink.delivered()
        conn.commit()
    open_for = time.monotonic() - opened
    run_until(runner, lambda: sink.delivered(), timeout=15)
    since_last_read = time.monotonic() - before_last_read

    def sample(name: str) -> float:
        return registry.get_sample_value(name, {"sink": SINK}) or 0.0

    assert sample("outbox_relay_delivery_latency_seconds_count") == 1
    assert sample("outbox_relay_event_age_seconds_count") == 1
    assert sample("outbox_relay_event_age_seconds_sum") >= OPEN_SECONDS
    # At most the time from the last read that did not see it to the checkpoint after its delivery.
    latency = sample("outbox_relay_delivery_latency_seconds_sum")
    assert latency <= since_last_read < open_for
