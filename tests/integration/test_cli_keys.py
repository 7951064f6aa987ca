"""`outbox-relay keys show | retry | skip | pause | resume` against a real database and real relay runners:
what the commands print, their --json and exit codes. What the actions do to the relays (a paused key
held in order and resumed without loss, a skip racing a retry in flight, the wake-ups) is tested on
``outbox_relay.admin`` directly, in test_admin.py.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import cli, store
from tests.cli_helpers import run_cli
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    SINK,
    RecordingSink,
    bucket_of,
    dead_letters,
    dedup_per_key,
    fail_ids,
    fetch_all,
    keys_in_bucket,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    register,
    run_until,
    runner_for,
    settled,
)

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


def keys(capsys: pytest.CaptureFixture[str], dsn: str, action: str, key: str, *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, "keys", action, "--dsn", dsn, key, *argv)


def show(capsys: pytest.CaptureFixture[str], dsn: str, key: str, sink: str = SINK) -> dict[str, Any]:
    """``keys show --json`` for one sink."""
    code, out, err = keys(capsys, dsn, "show", key, "--sink", sink, "--json")
    assert code == cli.EXIT_OK, err
    report = json.loads(out)
    [state] = report["sinks"]
    return {"bucket": report["bucket"], **state}


# -- show -------------------------------------------------------------------------------------


def test_show_says_why_a_key_waits(dsn: str, pool: ConnectionPool[Any], capsys: pytest.CaptureFixture[str]) -> None:
    ids = publish(dsn, [("order:1", "Placed", {}), ("order:1", "Paid", {}), ("order:1", "Shipped", {}),
                        ("order:2", "Placed", {})])
    sink = RecordingSink(fail=fail_ids({ids[0]}, "KafkaError{code=MSG_TIMED_OUT}"))
    # A long backoff: the head waits for its retry while we look.
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: sink.delivered_ids() == {ids[3]} and len(parked_ids(dsn)) == 3)
    [late] = publish(dsn, [("order:1", "Refunded", {})])  # committed, not read yet

    code, out, err = keys(capsys, dsn, "show", "order:1", "--sink", SINK)
    assert code == cli.EXIT_OK, err
    lines = out.splitlines()
    assert lines[0] == f"key 'order:1' (bucket {bucket_of(dsn, 'order:1')})"
    assert lines[1].startswith(f"  {SINK}: waiting for a retry in "), out
    assert " s (attempt 1 of 10 failed: KafkaError{code=MSG_TIMED_OUT}); 2 event(s) queued behind it" in lines[1], out
    assert f"parked head: event {ids[0]} (Placed), 1 failed attempt(s)" in out
    assert "held by w (fence 1" in out and "not read by the sink yet: 1 event(s)" in out, out

    state = show(capsys, dsn, "order:1")
    assert state["state"] == "retrying" and state["owner"] == "w" and state["bucket"] == bucket_of(dsn, "order:1")
    assert state["head"]["event_id"] == str(ids[0]) and state["head"]["attempts"] == 1
    assert 25 < state["head"]["retry_in_seconds"] <= 60  # 30-60 s: the backoff with its jitter
    assert state["head"]["last_error"] == "KafkaError{code=MSG_TIMED_OUT}"
    assert (state["parked"], state["queued_behind"], state["unread"], state["undelivered"]) == (3, 2, 1, 4)
    assert state["paused"] is None and state["dead_letters"]["count"] == 0
    assert show(capsys, dsn, "order:2")["summary"] == "flowing (nothing waiting)"
    assert late not in sink.delivered_ids()


def test_show_states_and_errors(dsn: str, pool: ConnectionPool[Any], capsys: pytest.CaptureFixture[str]) -> None:
    ids = publish(dsn, [("k", "t", {}), ("k", "t", {})])
    sink = RecordingSink(fail=fail_ids({ids[0]}, "too large"))
    runner = runner_for(sink, pool, make_settings(dsn, "w", max_attempts=1))
    run_until(runner, lambda: sink.delivered_ids() == {ids[1]})
    state = show(capsys, dsn, "k")
    assert state["state"] == "dead-lettered"
    assert state["summary"].startswith("dead-lettered head moved on (1 dead letter(s), the last at "), state
    assert [d["event_id"] for d in state["dead_letters"]["recent"]] == [str(ids[0])]
    assert state["dead_letters"]["recent"][0]["last_error"] == "too large"
    # A new event on its way while no relay holds the bucket: the line says both.
    [waiting] = publish(dsn, [("k", "t", {})])
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox.cursors SET owner = NULL, lease_expires_at = NULL")
    state = show(capsys, dsn, "k")
    assert state["summary"].endswith(f": too large); 1 event(s) on their way; no relay holds bucket "
                                     f"{state['bucket']} now"), state["summary"]
    assert state["owner"] is None and state["unread"] == 1 and waiting not in sink.delivered_ids()

    # Every sink when none is named; a key nothing was published under is unknown (a typo must not look fine).
    code, out, _ = keys(capsys, dsn, "show", "never-published")
    assert code == cli.EXIT_OK and f"  {SINK}: unknown: no event of this key is stored" in out, out
    code, _, err = keys(capsys, dsn, "show", "k", "--sink", "nope")
    assert code == cli.EXIT_ERROR and "no sink named 'nope'" in err, err
    code, _, err = keys(capsys, dsn, "show", "k", "--max-attempts", "0")
    assert code == cli.EXIT_ERROR and "--max-attempts: must be 1-1000, not 0" in err, err
    code, _, err = keys(capsys, dsn, "show", "")
    assert code == cli.EXIT_ERROR and "a partition key is not empty" in err, err
    code, _, err = keys(capsys, dsn, "show", "x" * 1025)
    assert code == cli.EXIT_ERROR and "at most 1024 bytes, not 1025" in err, err
    code, _, err = keys(capsys, dsn, "pause", "k")
    assert code == cli.EXIT_ERROR and "the following arguments are required: --sink" in err, err


# -- retry ------------------------------------------------------------------------------------


def test_retry_refuses_a_key_with_nothing_parked_or_paused(dsn: str, pool: ConnectionPool[Any],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    register(dsn)
    code, _, err = keys(capsys, dsn, "retry", "k", "--sink", SINK)
    assert code == cli.EXIT_ERROR
    assert f"nothing to retry: no event of key 'k' is parked for sink '{SINK}'" in err, err
    assert f"outbox-relay keys show k --sink {SINK}" in err
    code, _, err = keys(capsys, dsn, "retry", "k", "--sink", "nope")
    assert code == cli.EXIT_ERROR and "no sink named 'nope'" in err, err

    ids = publish(dsn, [("k", "t", {})])
    sink = RecordingSink(fail=fail_ids(set(ids)))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: parked_ids(dsn) == set(ids))
    assert keys(capsys, dsn, "pause", "k", "--sink", SINK)[0] == cli.EXIT_OK
    before = fetch_all(dsn, "SELECT available_at FROM outbox.parked")
    code, _, err = keys(capsys, dsn, "retry", "k", "--sink", SINK)
    assert code == cli.EXIT_ERROR and "key 'k' is paused for sink" in err and "keys resume k" in err, err
    assert fetch_all(dsn, "SELECT available_at FROM outbox.parked") == before

    code, out, err = keys(capsys, dsn, "resume", "k", "--sink", SINK)
    assert code == cli.EXIT_OK and "its 1 parked event(s) are due now, in order" in out, (out, err)
    code, out, err = keys(capsys, dsn, "retry", "k", "--sink", SINK)
    assert code == cli.EXIT_OK, err
    assert out.startswith(f"event {ids[0]} (t), the head of key 'k', is due now for sink '{SINK}'"), out
    assert "then the 0 event(s) behind it" in out, out
    code, out, _ = keys(capsys, dsn, "retry", "k", "--sink", SINK, "--json")
    assert json.loads(out) == {"action": "retry", "sink": SINK, "key": "k", "bucket": bucket_of(dsn, "k"),
                               "event_id": str(ids[0]), "type": "t", "attempts": 1, "last_error": "broker said no",
                               "paused": False}


# -- skip -------------------------------------------------------------------------------------


def test_skip_dead_letters_the_head_and_the_key_moves_on(dsn: str, pool: ConnectionPool[Any],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    ids = publish(dsn, [("k", "a", {}), ("k", "b", {}), ("k", "c", {})])
    sink = RecordingSink(fail=fail_ids({ids[0]}, "poison"))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: len(parked_ids(dsn)) == 3)

    code, _, err = keys(capsys, dsn, "skip", "k", "--sink", SINK, "--event", str(ids[1]))
    assert code == cli.EXIT_ERROR
    assert f"event {ids[1]} is not the head of key 'k' for sink '{SINK}' (the head is {ids[0]})" in err, err
    assert len(parked_ids(dsn)) == 3 and dead_letters(dsn) == {}

    code, out, err = keys(capsys, dsn, "skip", "k", "--sink", SINK, "--event", str(ids[0]), "--json")
    assert code == cli.EXIT_OK, err
    result = json.loads(out)
    assert (result["event_id"], result["now_due"], result["attempts"]) == (str(ids[0]), 2, 1)
    assert dead_letters(dsn) == {ids[0]: (1, cli.SKIPPED_ERROR)}
    state = show(capsys, dsn, "k")
    assert state["state"] == "due" and state["head"]["event_id"] == str(ids[1])
    assert state["summary"] == "retry due now (not attempted yet); 1 event(s) queued behind it", state["summary"]
    # The key moves on at once: the events behind the head were due already, the runner has no reason to wait
    # (its first batch there may be fenced out: skip fences the bucket, and the runner acquires it again).
    run_until(runner, lambda: sink.delivered_ids() == {ids[1], ids[2]} and not parked_ids(dsn))
    assert dedup_per_key(sink.attempts)["k"] == [ids[1], ids[2]]
    assert parked_ids(dsn) == set()
    assert show(capsys, dsn, "k")["state"] == "dead-lettered"

    code, _, err = keys(capsys, dsn, "skip", "k", "--sink", SINK)
    assert code == cli.EXIT_ERROR and "nothing to skip: no event of key 'k' is parked" in err, err


# -- pause and resume -------------------------------------------------------------------------


def test_pause_and_resume_are_idempotent_and_need_a_live_sink(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    register(dsn)
    code, out, err = keys(capsys, dsn, "pause", "k", "--sink", SINK, "--reason", "first")
    assert code == cli.EXIT_OK, err
    assert f"paused key 'k' for sink '{SINK}'" in out and f"keys resume k --sink {SINK}" in out, out
    state = show(capsys, dsn, "k")
    assert state["state"] == "paused" and state["summary"].startswith("paused since "), state
    assert "@" in state["paused"]["by"] and state["paused"]["role"] and state["paused"]["reason"] == "first"
    code, out, _ = keys(capsys, dsn, "pause", "k", "--sink", SINK, "--reason", "second", "--json")
    assert code == cli.EXIT_OK
    result = json.loads(out)
    assert result["already_paused"] is True and result["reason"] == "first"
    code, out, _ = keys(capsys, dsn, "resume", "k", "--sink", SINK)
    assert code == cli.EXIT_OK and "resumed key 'k'" in out and "its 0 parked event(s) are due now" in out, out
    code, out, _ = keys(capsys, dsn, "resume", "k", "--sink", SINK)
    assert code == cli.EXIT_OK and "key 'k' is not paused for sink" in out, out
    code, _, err = keys(capsys, dsn, "pause", "k", "--sink", "nope")
    assert code == cli.EXIT_ERROR and "no sink named 'nope'" in err, err

    # A dropped sink takes its pauses along: recreated, it starts with none.
    assert keys(capsys, dsn, "pause", "k", "--sink", SINK)[0] == cli.EXIT_OK
    assert cli.main(["sinks", "--dsn", dsn, "drop", SINK]) == cli.EXIT_OK
    code, _, err = keys(capsys, dsn, "pause", "k", "--sink", SINK)
    assert code == cli.EXIT_ERROR and f"sink '{SINK}' was dropped" in err, err
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.paused_keys") == [(0,)]


# -- what the relay's queries see -------------------------------------------------------------


def test_an_idle_relay_waits_for_a_head_s_retry_time_not_for_the_events_queued_behind_it(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """The events queued behind a failed head are parked due at once (they wait for the head, not for a
    time of their own). The runner's park timer must follow the head: when it followed the queue, an idle
    relay polled the park every few milliseconds for as long as the head waited."""
    ids = publish(dsn, [("k", "t", {}), ("k", "t", {}), ("k", "t", {})])
    sink = RecordingSink(fail=fail_ids({ids[0]}))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: len(parked_ids(dsn)) == 3)
    bucket = bucket_of(dsn, "k")
    with psycopg.connect(dsn, autocommit=True) as conn:
        queued_due = fetch_all(dsn, "SELECT count(*) FROM outbox.parked WHERE available_at <= clock_timestamp()")
        assert queued_due == [(2,)], "the queue behind the head is parked due at once"
        due_in = store.next_parked_retry(conn, SINK, [bucket])
    assert due_in is not None and 25 < due_in <= 60  # the head's backoff (30-60 s with its jitter)

