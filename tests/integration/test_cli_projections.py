"""The `outbox-relay` command with projections misconfigured: a clear error naming the problem,
exit status 2, and nothing started or written."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest

from tests.integration.relay_helpers import fetch_all, publish
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
     "cannot import projections module 'no_such_module'"),
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
