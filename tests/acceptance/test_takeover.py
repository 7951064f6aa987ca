"""Acceptance (issue 15): a killed relay's buckets move about --worker-ttl-seconds after its last
heartbeat. The heartbeat that stores the assignment without it has its relay run a housekeeping pass at
once, which declares the silent relay dead and frees its leases; nothing waits for the next periodic
pass or for the leases to expire (both 600 s here, so only that path can move them in time).
"""

from __future__ import annotations

import signal

import psycopg
import pytest

from outbox_relay import Outbox
from tests.acceptance.projection_app import SCHEMA
from tests.acceptance.test_relay_processes import Relays, db_rows
from tests.servers import wait_until

pytestmark = pytest.mark.slow

ARGS = ["--no-kafka", "--projections", "tests.acceptance.projection_app", "--projection", "ledger",
        "--housekeeping-seconds", "600", "--lease-seconds", "600"]


def owners(dsn: str) -> dict[str, int]:
    return dict(db_rows(dsn, "SELECT owner, count(*) FROM outbox.cursors WHERE sink = 'ledger' AND owner IS NOT NULL "
                             "GROUP BY owner"))


def test_a_killed_relays_buckets_move_without_waiting_for_housekeeping_or_lease_expiry(
        dsn: str, relays: Relays) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    a = relays.start("a", dsn, "unused:9", "unused", ARGS)
    b = relays.start("b", dsn, "unused:9", "unused", ARGS)
    wait_until(lambda: owners(dsn) == {"a": 128, "b": 128}, 60, 0.2, "both relays holding their share")
    a.signal(signal.SIGKILL)
    a.proc.wait(10)
    # The TTL is 2 s (the acceptance relays' fast knobs): generously bounded, far below 600 s.
    wait_until(lambda: owners(dsn) == {"b": 256}, 30, 0.2, "b holding every bucket")
    with psycopg.connect(dsn) as conn:
        ids = [str(Outbox(default_topic="t").publish(conn, type="acceptance.counted", key=f"k{i}",
                                                     payload={"key": f"k{i}", "n": 1}).id) for i in range(50)]
    wait_until(lambda: len(db_rows(dsn, "SELECT 1 FROM ledger")) == len(ids), 30, 0.2, "every event applied by b")
    assert b.terminate() == 0
