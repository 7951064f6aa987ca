"""The `outbox-relay` command with projections misconfigured: a clear error naming the problem,
exit status 2, and nothing started or written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psycopg
import pytest

from outbox_relay.compose import build_worker
from outbox_relay.settings import RelaySettings
from tests.integration.relay_helpers import fetch_all, publish, running
from tests.servers import wait_until


def env_for(dsn: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "OUTBOX_DSN": dsn, **extra}
    env.pop("OUTBOX_PROJECTIONS", None)
    env.pop("OUTBOX_PROJECTION", None)
    return env


def run(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "outbox_relay.cli", *args], env=env_for(dsn), capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(("args", "message"), [
    (["run", "--no-kafka", "--projection", "order_totals"], "--projection needs --projections"),
    (["run", "--no-kafka", "--projections", "no_such_module", "--projection", "x"],
     "--projections no_such_module: no module named 'no_such_module'"),
    (["run", "--no-kafka", "--projections", "tests.integration.projection_app", "--projection", "nope"],
     "unknown projection 'nope' (known: customer_orders, order_totals)"),
    (["run", "--no-kafka"], "no sink to run"),
    (["rebuild", "order_totals"], "rebuild needs --projections"),
    (["rebuild", "nope", "--projections", "tests.integration.projection_app"], "unknown projection 'nope'"),
    (["rebuild", "order_totals", "--projections", "tests.integration.projection_app", "--from-position", "12"],
     "a position is XID:SEQ"),
    (["rebuild", "order_totals", "--projections", "tests.integration.projection_app", "--from-position",
      "99999999999:1"], "--from-position 99999999999:1 is past every transaction id there is"),
    (["rebuild", "order_totals", "--projections", "tests.integration.projection_app", "--from-time",
      "2999-01-01T00:00:00Z"], "is in the future"),
    (["sinks", "drop", "nope"], "no sink named 'nope'"),
    (["lag", "--sink", "nope"], "no sink named 'nope'"),
])
def test_misconfiguration_is_named_and_nothing_starts(dsn: str, args: list[str], message: str) -> None:
    result = run(dsn, *args)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.workers") == [(0,)]


def test_rebuild_of_a_projection_whose_table_is_missing_names_the_table(dsn: str) -> None:
    result = run(dsn, "rebuild", "order_totals", "--projections", "tests.integration.projection_app")
    assert result.returncode == 2
    assert "table 'order_totals' does not exist" in result.stderr, result.stderr


def test_a_rebuild_cancelled_from_another_terminal_exits_non_zero_and_says_so(dsn: str) -> None:
    """Item 9: `rebuild --cancel` while `rebuild` runs: the running one must not print success and exit 0."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE order_totals (customer text PRIMARY KEY, orders int NOT NULL, "
                     "paid_cents bigint NOT NULL)")
    publish(dsn, [(f"c{i % 50}", "OrderPlaced", {"customer": f"c{i % 50}"}) for i in range(3000)])
    app = ["--projections", "tests.integration.projection_app", "--batch-size", "100"]
    rebuilding = subprocess.Popen([sys.executable, "-m", "outbox_relay.cli", "rebuild", "order_totals", *app],
                                  env=env_for(dsn, OUTBOX_TEST_APPLY_SECONDS="0.002"), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        def replaying() -> bool:
            copied = fetch_all(dsn, "SELECT to_regclass('outbox_rebuild_order_totals.order_totals') IS NOT NULL")
            return bool(copied[0][0]) and bool(
                fetch_all(dsn, "SELECT count(*) FROM outbox_rebuild_order_totals.order_totals")[0][0])

        wait_until(replaying, 60, 0.05, "the rebuild replaying")
        cancel = run(dsn, "rebuild", "order_totals", *app, "--cancel")
        assert cancel.returncode == 0 and "cancelled" in cancel.stdout, cancel.stdout + cancel.stderr
        out, err = rebuilding.communicate(timeout=60)
    finally:
        if rebuilding.poll() is None:
            rebuilding.kill()
            rebuilding.communicate()
    assert rebuilding.returncode == 2, (rebuilding.returncode, out, err)
    assert "was cancelled while it ran" in err and "rebuilt" not in out, out + err
    assert "Traceback" not in err
    assert fetch_all(dsn, "SELECT count(*) FROM order_totals") == [(0,)], "the (empty) live table was replaced"


def test_a_relay_whose_sink_is_dropped_under_it_exits_with_status_4(dsn: str) -> None:
    """README, exit codes: `run` stops by itself with 4 when its sink is dropped (`sinks drop --force`),
    instead of idling as if it still delivered."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE order_totals (customer text PRIMARY KEY, orders int NOT NULL, "
                     "paid_cents bigint NOT NULL)")
    publish(dsn, [(f"c{i % 5}", "OrderPlaced", {"customer": f"c{i % 5}"}) for i in range(20)])
    relay = subprocess.Popen([sys.executable, "-m", "outbox_relay.cli", "run", "--no-kafka", "--worker-id", "cli-w",
                              "--projections", "tests.integration.projection_app", "--projection", "order_totals",
                              "--heartbeat-seconds", "0.2", "--poll-seconds", "0.1",
                              "--lease-seconds", "3"],  # a relay learns of the drop when it renews (a third of it)
                             env=env_for(dsn), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: fetch_all(dsn, "SELECT coalesce(sum(orders), 0) FROM order_totals") == [(20,)], 60, 0.1,
                   "the relay applying the first events")
        dropped = run(dsn, "sinks", "drop", "order_totals", "--force")
        assert dropped.returncode == 0, dropped.stdout + dropped.stderr
        out, err = relay.communicate(timeout=60)
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.communicate()
    assert relay.returncode == 4, (relay.returncode, out, err[-2000:])
    assert "dropped" in err and "Traceback" not in err, err[-2000:]
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.cursors WHERE sink = 'order_totals'") == [(0,)]


def test_a_relay_stopped_inside_its_transaction_does_not_hold_the_next_owner_back(dsn: str) -> None:
    """Issue 7, item 8: a relay process stopped (SIGSTOP: paused, partitioned) in the middle of a pipelined
    projection batch holds row locks in an open transaction, and a pipeline that is never synced is not
    cut off by idle_in_transaction_session_timeout. Once its lease runs out, the housekeeper that takes
    the lease back ends that transaction, so the next owner, which must write the same rows, gets on
    and every event lands exactly once."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE order_totals (customer text PRIMARY KEY, orders int NOT NULL, "
                     "paid_cents bigint NOT NULL)")
    customers = 4
    publish(dsn, [(f"c{i % customers}", "OrderPlaced", {"customer": f"c{i % customers}"}) for i in range(400)])
    stalled = subprocess.Popen(
        [sys.executable, "-m", "outbox_relay.cli", "run", "--no-kafka", "--worker-id", "to-stop",
         "--projections", "tests.integration.projection_app", "--projection", "order_totals",
         "--batch-size", "40", "--lease-seconds", "2", "--heartbeat-seconds", "0.3", "--worker-ttl-seconds", "2"],
        env=env_for(dsn, OUTBOX_TEST_APPLY_SECONDS="0.02"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, stdin=subprocess.DEVNULL)
    # Its open transaction has written order_totals rows (which the next owner must update too).
    holding_locks = ("SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                     "WHERE a.application_name = 'outbox-relay to-stop' "
                     "AND l.relation = 'order_totals'::regclass AND l.mode = 'RowExclusiveLock'")
    try:
        wait_until(lambda: fetch_all(dsn, "SELECT coalesce(sum(orders), 0) FROM order_totals")[0][0] > 0, 60, 0.05,
                   "the first relay applying events")
        for _ in range(100):  # stop it while a batch that wrote rows is open
            stalled.send_signal(signal.SIGSTOP)
            if fetch_all(dsn, holding_locks) == [(1,)]:
                break
            stalled.send_signal(signal.SIGCONT)
            time.sleep(0.01)
        else:
            raise AssertionError("never caught the relay inside a batch that wrote")
        worker = build_worker(RelaySettings(
            dsn=dsn, worker_id="next-owner", kafka=False, projections="tests.integration.projection_app",
            projection=["order_totals"], heartbeat_seconds=0.3, worker_ttl_seconds=2, lease_seconds=2,
            housekeeping_seconds=0.5))
        with running(worker):
            wait_until(lambda: fetch_all(dsn, "SELECT sum(orders) FROM order_totals") == [(400,)], 60, 0.1,
                       "the next owner applying every event while the stopped relay still holds its transaction")
        assert fetch_all(dsn, holding_locks) == [(0,)], "the stopped relay's transaction was ended"
        # (without that, the next owner waits for the stopped relay's row locks: the wait above times out)
        assert fetch_all(dsn, "SELECT customer, orders FROM order_totals ORDER BY customer") == [
            (f"c{i}", 400 // customers) for i in range(customers)], "each event exactly once"
    finally:
        stalled.kill()
        stalled.communicate()
