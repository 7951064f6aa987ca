"""Paused keys in the progress reports, against a real PostgreSQL and a real relay runner.

A key an operator paused for a sink (``outbox-relay keys pause``) has its events held (parked, or about
to be) until it is resumed: no attempt comes before that. ``wait_for`` must say so instead of calling
them "retrying" with no error, and ``status`` / ``lag`` must count them apart from events waiting for a
retry.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import cli, wait_for
from outbox_relay.errors import WaitTimeout
from outbox_relay.sinks.engine import Failure
from outbox_relay.store import StoredEvent
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    SINK,
    RecordingSink,
    keys_in_bucket,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    register,
    run_until,
    runner_for,
)

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

REASON = "fixing its read model"


def pause(dsn: str, key: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["keys", "pause", "--dsn", dsn, key, "--sink", SINK, "--reason", REASON]) == cli.EXIT_OK
    capsys.readouterr()


def fail_ids(ids: set[uuid.UUID]) -> Any:
    def fail(e: StoredEvent, _n: int) -> Failure | None:
        return Failure("broker said no") if e.id in ids else None
    return fail


def test_wait_for_reports_a_paused_key_s_events_as_paused_naming_the_pause(
        dsn: str, pool: ConnectionPool[Any], capsys: pytest.CaptureFixture[str]) -> None:
    paused, other = keys_in_bucket(dsn, 5, 2, prefix="wait-")
    register(dsn)
    pause(dsn, paused, capsys)
    held = publish(dsn, [(paused, "t", {"n": 1}), (paused, "t", {"n": 2})])
    [fine] = publish(dsn, [(other, "t", {})])
    sink = RecordingSink()
    runner = runner_for(sink, pool, make_settings(dsn, "w"))
    run_until(runner, lambda: fine in sink.delivered_ids() and parked_ids(dsn) == set(held))
    [unread] = publish(dsn, [(paused, "t", {"n": 3})])  # committed, not read by the relay yet

    with psycopg.connect(dsn, autocommit=True) as conn:
        wait_for(conn, fine, sink=SINK, timeout=0)
        with pytest.raises(WaitTimeout) as timed_out:
            wait_for(conn, [*held, unread], sink=SINK, timeout=0.2)
    error = timed_out.value
    # Not "retrying" (no retry comes while paused, and there is no error), nor "pending" for the unread one.
    assert (error.pending, error.retrying) == ((), ()), str(error)
    assert error.paused == (*held, unread), str(error)
    message = str(error)
    assert "0 pending, 0 retrying, 3 paused" in message, message
    assert f"key {paused!r} is paused for sink {SINK!r} by " in message and f": {REASON};" in message, message
    assert f"`outbox-relay keys resume {paused} --sink {SINK}`" in message, message
    assert not [a for a in sink.attempts if a.key == paused], "a paused key's event was attempted"

    assert cli.main(["keys", "resume", "--dsn", dsn, paused, "--sink", SINK]) == cli.EXIT_OK
    run_until(runner, lambda: {*held, unread} <= sink.delivered_ids())
    with psycopg.connect(dsn, autocommit=True) as conn:
        wait_for(conn, [*held, unread], sink=SINK, timeout=0)


def test_status_and_lag_count_paused_events_apart_from_parked_ones(
        dsn: str, pool: ConnectionPool[Any], capsys: pytest.CaptureFixture[str]) -> None:
    paused, failing, other = keys_in_bucket(dsn, 9, 3, prefix="lag-")
    register(dsn)
    pause(dsn, paused, capsys)
    held = publish(dsn, [(paused, "t", {"n": 1}), (paused, "t", {"n": 2})])
    head, behind = publish(dsn, [(failing, "t", {"n": 1}), (failing, "t", {"n": 2})])
    [fine] = publish(dsn, [(other, "t", {})])
    sink = RecordingSink(fail=fail_ids({head}))
    # A long backoff: the failed head waits for its retry while we look.
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: fine in sink.delivered_ids() and parked_ids(dsn) == {*held, head, behind})

    assert cli.main(["lag", "--dsn", dsn, "--sink", SINK, "--json"]) == cli.EXIT_OK
    [row] = json.loads(capsys.readouterr().out)
    assert row["parked"] == 2, row  # the failed head and the event behind it: waiting for a retry
    assert (row["paused"], row["paused_keys"]) == (2, 1), row  # held until the key is resumed
    assert cli.main(["status", "--dsn", dsn, "--json"]) == cli.EXIT_OK
    [backlog] = [r for r in json.loads(capsys.readouterr().out)["backlog"] if r["sink"] == SINK]
    assert (backlog["parked"], backlog["paused"], backlog["paused_keys"]) == (2, 2, 1), backlog
    assert cli.main(["status", "--dsn", dsn]) == cli.EXIT_OK
    table = capsys.readouterr().out
    assert "paused_keys" in table, table
