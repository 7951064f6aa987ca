"""The `outbox-relay` command with projections misconfigured: a clear error naming the problem,
exit status 2, and nothing started or written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.integration.relay_helpers import fetch_all


def run(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUTBOX_DSN": dsn}
    env.pop("OUTBOX_PROJECTIONS", None)
    env.pop("OUTBOX_PROJECTION", None)
    return subprocess.run([sys.executable, "-m", "outbox_relay.cli", *args], env=env, capture_output=True,
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
