"""Acceptance (issue 15): a connection storm. Every relay backend is terminated every 0.5 s for 12 s
while producers publish; a connection error is not a poison event and no reason for a long pause, so
the backlog is gone within seconds of the last kill, nothing lost, per-key order kept.

Before, failed cycles backed off up to 30 s (``Backoff(0.5, 30.0)``) while the leases were renewed,
and 25 s after the kills about 8,000 events still waited.
"""

from __future__ import annotations

import re
import threading
import time

import psycopg
import pytest

from tests.acceptance.test_relay_processes import (
    Producers,
    Published,
    Relays,
    assert_delivered_in_order,
    db_rows,
    read_topic,
    wait_drained,
)

pytestmark = pytest.mark.slow

# Long enough for a backoff that doubles per failed cycle to pass the 5 s pause the test allows (0.5, 1, 2,
# 4, 8 s: the old Backoff(0.5, 30.0) paused 8 s within 8 s of failures).
STORM_SECONDS = 12.0
KILL_EVERY = 0.5
# Generous: a few seconds is what it takes here. With the old backoff (up to 30 s, doubling with each failed
# cycle in a row) a relay was still pausing 8-30 s after a storm this long.
DRAINED_WITHIN = 15.0
# The shipped defaults (the acceptance relays' fast knobs would hide the problem: a heartbeat every 0.5 s
# finds each dead pooled connection before a runner does).
DEFAULTS = ["--lease-seconds", "30", "--heartbeat-seconds", "2", "--worker-ttl-seconds", "10",
            "--housekeeping-seconds", "5", "--poll-seconds", "1"]


def storm(dsn: str, stop: threading.Event, kills: list[int]) -> None:
    """Terminate every relay backend (pool, LISTEN, projection connections) every KILL_EVERY seconds."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.wait(KILL_EVERY):
            rows = conn.execute("SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                                "WHERE application_name LIKE 'outbox-relay %%' AND pid <> pg_backend_pid()").fetchone()
            kills.append(int(rows[0]) if rows else 0)


def test_relays_drain_the_backlog_within_seconds_of_a_connection_storm(
        dsn: str, relays: Relays, kafka_bootstrap: str, kafka_topic: str) -> None:
    for name in ("r1", "r2"):
        relays.start(name, dsn, kafka_bootstrap, kafka_topic, DEFAULTS)
    keys = [f"key-{i:02d}" for i in range(40)]
    published = Published()
    wait_drained(dsn, 60)  # both registered and idle
    stop, kills = threading.Event(), list[int]()
    killer = threading.Thread(target=storm, args=(dsn, stop, kills), daemon=True)
    producers = Producers(dsn, kafka_topic, keys, int(STORM_SECONDS * 300), published, producers=2, rate=300)
    killer.start()
    try:
        time.sleep(STORM_SECONDS)
    finally:
        stop.set()
        killer.join(10)
    producers.join()
    assert sum(kills) > STORM_SECONDS / KILL_EVERY, f"the storm ended few backends: {kills}"
    # Within a few seconds of the last kill (checked generously): nothing pending, nothing parked.
    wait_drained(dsn, DRAINED_WITHIN)
    assert db_rows(dsn, "SELECT count(*) FROM outbox.dead_letters") == [(0,)], "a connection error dead-lettered"
    records = read_topic(kafka_bootstrap, kafka_topic, published.count(), timeout=60, settle=1.0)
    assert_delivered_in_order(published, records)
    for r in relays.started:
        assert r.running, r.tail()
        # A connection error is no reason for a long pause: failed cycles back off for seconds at most.
        pauses = [float(p) for p in re.findall(r"cycle failed .*; retrying in ([0-9.]+)s", r.stderr())]
        assert pauses and max(pauses) <= 5.0, f"relay {r.worker_id} paused {max(pauses, default=0):.1f}s after a " \
                                              "failed cycle"
