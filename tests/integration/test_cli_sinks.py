"""`outbox-relay sinks drop | recreate | list` against a real database, through ``cli.main``.

A drop refuses a sink that relays still run or hold leases on (``--force`` drops it anyway and says
what that cost), leaves a tombstone instead of deleting the row, and can not race a relay that takes
a lease while the drop checks. Retention then ignores the dropped sink."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from outbox_relay import cli, store
from tests.cli_helpers import run_cli
from tests.integration.relay_helpers import fetch_all, publish, register
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

SINK = "old_model"


def sinks(capsys: pytest.CaptureFixture[str], dsn: str, *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, "sinks", "--dsn", dsn, *argv)


def heartbeat(dsn: str, worker: str, sink_names: list[str], status: str = "alive") -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.heartbeat(conn, worker, status, sink_names, {})


def lease(dsn: str, worker: str, buckets: range, sink: str = SINK, seconds: float = 30.0) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert len(store.acquire_leases(conn, sink, worker, buckets, seconds)) == len(buckets)


def state(dsn: str, sink: str = SINK) -> dict[str, Any]:
    (dropped,) = fetch_all(dsn, "SELECT dropped_at IS NOT NULL FROM outbox.sinks WHERE name = %s", (sink,))[0]
    counts = {t: fetch_all(dsn, f"SELECT count(*) FROM outbox.{t} WHERE sink = %s", (sink,))[0][0]
              for t in ("cursors", "parked", "dead_letters")}
    return {"dropped": dropped, **counts}


def park_and_dead_letter(dsn: str, sink: str = SINK) -> None:
    """One parked event and one dead letter for ``sink`` (rows as the relay's checkpoint writes them)."""
    publish(dsn, [("k1", "t", {}), ("k2", "t", {})])
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT bucket, xid, seq, partition_key, id FROM outbox.events ORDER BY seq").fetchall()
        b, x, s, k, i = rows[0]
        conn.execute("INSERT INTO outbox.parked (sink, bucket, xid, seq, partition_key, event_id, attempts, "
                     "last_error) VALUES (%s, %s, %s, %s, %s, %s, 1, 'boom')", (sink, b, x, s, k, i))
        b, x, s, k, i = rows[1]
        conn.execute("INSERT INTO outbox.dead_letters (sink, event_id, bucket, xid, seq, partition_key, attempts, "
                     "last_error) VALUES (%s, %s, %s, %s, %s, %s, 3, 'boom')", (sink, i, b, x, s, k))


def test_drop_refuses_a_sink_that_a_live_relay_runs(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    register(dsn, SINK)
    heartbeat(dsn, "relay-a", ["kafka", SINK])
    code, _, err = sinks(capsys, dsn, "drop", SINK)
    assert code == cli.EXIT_ERROR, err
    assert f"sink '{SINK}' is in use: relay relay-a (alive, heard from" in err, err
    assert "--force" in err and "a relay still running it stops" in err, err
    assert state(dsn) == {"dropped": False, "cursors": 256, "parked": 0, "dead_letters": 0}


def test_drop_refuses_a_sink_with_unexpired_leases(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    register(dsn, SINK)
    lease(dsn, "relay-b", range(0, 10))  # a relay whose registry row is gone (or not written yet)
    code, _, err = sinks(capsys, dsn, "drop", SINK)
    assert code == cli.EXIT_ERROR and "10 bucket(s) leased by relay-b" in err, err
    assert state(dsn)["cursors"] == 256


def test_silent_dead_and_other_sinks_relays_do_not_hold_a_drop(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    register(dsn, SINK)
    heartbeat(dsn, "dead-relay", [SINK], status="dead")
    heartbeat(dsn, "silent-relay", [SINK])
    heartbeat(dsn, "other-relay", ["kafka"])
    lease(dsn, "silent-relay", range(0, 5), seconds=0.1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox.workers SET last_seen_at = clock_timestamp() - interval '1 hour' "
                     "WHERE id = 'silent-relay'")
    wait_until(lambda: fetch_all(dsn, "SELECT bool_and(lease_expires_at < clock_timestamp()) FROM outbox.cursors "
                                      "WHERE owner IS NOT NULL")[0][0], 5, message="the short leases to expire")
    code, out, err = sinks(capsys, dsn, "drop", SINK)
    assert code == cli.EXIT_OK, err
    assert f"dropped sink '{SINK}' (projection): 0 pending event(s) never reach it" in out, out
    assert "in use" not in out


def test_forced_drop_says_what_it_costs_and_leaves_a_tombstone(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    register(dsn, SINK)
    park_and_dead_letter(dsn)
    publish(dsn, [("k3", "t", {})])
    heartbeat(dsn, "relay-a", [SINK])
    lease(dsn, "relay-a", range(0, 256))
    code, out, err = sinks(capsys, dsn, "drop", SINK, "--force")
    assert code == cli.EXIT_OK, err
    # All three events are past the cursors (at position zero); one is parked, one dead-lettered.
    assert f"dropped sink '{SINK}' (projection): 3 pending event(s) never reach it, 1 parked event(s) and 1 dead " \
           "letter(s) deleted; it was in use (relay relay-a" in out, out
    assert "256 bucket(s) leased by relay-a" in out and "a relay still running it stops" in out, out
    assert f"outbox-relay sinks recreate {SINK}" in out
    assert state(dsn) == {"dropped": True, "cursors": 0, "parked": 0, "dead_letters": 0}
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.events") == [(3,)], "events themselves are kept"

    code, out, _ = sinks(capsys, dsn, "drop", SINK)
    assert code == cli.EXIT_OK and "already dropped at" in out



def test_list_shows_dropped_sinks_and_recreate_clears_the_tombstone(dsn: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    register(dsn, "kafka", "kafka")
    register(dsn, SINK)
    assert sinks(capsys, dsn, "drop", SINK)[0] == cli.EXIT_OK
    code, out, _ = sinks(capsys, dsn, "list")
    assert code == cli.EXIT_OK
    header, _, *rows = out.splitlines()
    assert header.split() == ["sink", "kind", "created_at", "dropped_at", "pending", "leased_buckets"], header
    assert rows[0].startswith("kafka ") and rows[1].startswith(SINK), out
    (dropped_at,) = fetch_all(dsn, "SELECT dropped_at FROM outbox.sinks WHERE name = %s", (SINK,))[0]
    assert f"{dropped_at:%Y-%m-%d %H:%M:%S}" in rows[1], out

    lag = cli.main(["lag", "--dsn", dsn, "--sink", SINK])
    assert lag == cli.EXIT_ERROR and f"sink '{SINK}' was dropped at" in capsys.readouterr().err

    code, out, err = sinks(capsys, dsn, "recreate", SINK)
    assert code == cli.EXIT_OK, err
    assert "the next relay that runs it registers it anew" in out and "oldest retained event" in out, out
    assert state(dsn) == {"dropped": False, "cursors": 0, "parked": 0, "dead_letters": 0}
    register(dsn, SINK)  # what the next relay does
    assert fetch_all(dsn, "SELECT count(*), max(snapshot::text) FROM outbox.cursors WHERE sink = %s", (SINK,)) \
        == [(256, "1:1:")]

    code, _, err = sinks(capsys, dsn, "recreate", SINK)
    assert code == cli.EXIT_ERROR and "is not dropped" in err
    code, _, err = sinks(capsys, dsn, "recreate", "nope")
    assert code == cli.EXIT_ERROR and "no sink named 'nope'" in err


def test_a_rebuild_in_progress_holds_a_drop_and_a_rebuilds_own_sink_takes_its_row(
        dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    register(dsn, SINK)
    register(dsn, f"{SINK}.rebuild")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox.rebuilds (projection, sink, shadow_schema, live_tables) "
                     "VALUES (%s, %s, %s, '{public.t}')", (SINK, f"{SINK}.rebuild", f"outbox_rebuild_{SINK}"))
    code, _, err = sinks(capsys, dsn, "drop", SINK)
    assert code == cli.EXIT_ERROR and f"a rebuild of it (sink '{SINK}.rebuild'" in err, err
    assert f"outbox-relay rebuild {SINK} --cancel" in err

    code, out, err = sinks(capsys, dsn, "drop", f"{SINK}.rebuild")
    assert code == cli.EXIT_OK, err
    assert f"the rebuild of '{SINK}' it belonged to is abandoned" in out, out
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.rebuilds") == [(0,)]
    assert sinks(capsys, dsn, "drop", SINK)[0] == cli.EXIT_OK

