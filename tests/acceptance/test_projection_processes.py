"""Acceptance: projections in real ``outbox-relay`` processes (G5, G6, G7, G12, and isolation
between sinks), with the projections of tests/acceptance/projection_app.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.acceptance.projection_app import SCHEMA
from tests.acceptance.test_relay_processes import (
    Producers,
    Published,
    Relays,
    assert_delivered_in_order,
    cli,
    db_rows,
    read_topic,
)
from tests.servers import wait_until

pytestmark = pytest.mark.slow

APP = ["--projections", "tests.acceptance.projection_app"]
FAST_RETRY = ["--backoff-base-seconds", "0.1", "--backoff-max-seconds", "0.5"]


def setup(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)


def ledger_by_key(dsn: str, table: str = "ledger") -> dict[str, list[str]]:
    """Per key, the applied event ids in the order they were applied."""
    out: dict[str, list[str]] = {}
    for event_id, key in db_rows(dsn, f"SELECT event_id::text, key FROM {table} ORDER BY id"):
        out.setdefault(key, []).append(event_id)
    return out


def assert_exactly_once_in_order(dsn: str, published: Published, table: str = "ledger") -> None:
    rows = db_rows(dsn, f"SELECT count(*), count(DISTINCT event_id) FROM {table}")[0]
    assert rows[0] == rows[1], f"{table}: {rows[0] - rows[1]} events were applied more than once"
    assert ledger_by_key(dsn, table) == published.by_key, f"{table}: lost or out of order"


def applied_count(dsn: str, table: str = "ledger") -> int:
    return int(db_rows(dsn, f"SELECT count(*) FROM {table}")[0][0])


def test_a_stopped_relay_cannot_land_its_projection_batch(dsn: str, relays: Relays, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """G7 with G5: relay A is SIGSTOPped inside a projection transaction; B takes its buckets over
    and applies the batch; when A is continued, its transaction must not land (the server cut it off
    after the lease, or the fence check refuses it): every event is applied exactly once, in order."""
    setup(dsn)
    pause_dir = tmp_path / "paused"
    pause_dir.mkdir()
    monkeypatch.setenv("OUTBOX_TEST_PAUSE_DIR", str(pause_dir))
    args = ["--no-kafka", *APP, "--projection", "ledger", *FAST_RETRY]
    a = relays.start("a", dsn, "unused:9", "unused", args)
    keys = [f"key-{i:02d}" for i in range(20)]
    published = Published()
    Producers(dsn, "t", keys, 300, published, producers=2, rate=600).join()
    wait_until(lambda: applied_count(dsn) == 300, 60, 0.2, "relay A applying the first 300 events")

    # One event makes A's handler sleep inside its transaction: stop A right there.
    from outbox_relay import Outbox
    with psycopg.connect(dsn) as conn:
        paused = [Outbox(default_topic="t").publish(conn, type="acceptance.counted", key="held",
                                                    payload={"key": "held", "n": n, "pause": 3.0 if n == 1 else 0})
                  for n in range(1, 6)]
    published.add("held", [str(p.id) for p in paused])
    wait_until(lambda: any(pause_dir.iterdir()), 30, 0.02, "A's handler to enter the paused event")
    a.signal(signal.SIGSTOP)
    b = relays.start("b", dsn, "unused:9", "unused", args)
    wait_until(lambda: len(ledger_by_key(dsn).get("held", [])) == 5, 60, 0.2, "relay B applying the held key")
    assert a.running, "A is only stopped"
    a.signal(signal.SIGCONT)

    more = Producers(dsn, "t", keys, 300, published, producers=2, rate=300)
    more.join()
    wait_until(lambda: applied_count(dsn) == published.count(), 60, 0.2, "every event applied")
    time.sleep(1.0)  # A's woken handler had its chance to land something
    assert applied_count(dsn) == published.count()
    assert_exactly_once_in_order(dsn, published)
    held_pids = {pid for (pid,) in db_rows(dsn, "SELECT DISTINCT pid FROM ledger WHERE key = 'held'")}
    assert held_pids == {b.proc.pid}, "the stopped relay's write landed"
    assert db_rows(dsn, "SELECT sum(applied), count(*) FROM counts")[0] == (published.count(), len(keys) + 1)
    cut_off = a.stderr()
    # Either the fence check refused A's checkpoint (its transaction rolled back), or the server had
    # already ended A's transaction: for sitting idle longer than the lease, or terminated by the
    # housekeeping pass that declared A dead.
    assert any(sign in cut_off for sign in ("fenced out of", "idle-in-transaction", "administrator command",
                                            "server closed the connection")), "A's stale batch did not fail visibly"
    assert a.terminate() == 0 and b.terminate() == 0


def test_a_relay_killed_mid_batch_leaves_nothing_of_a_batched_projection(dsn: str, relays: Relays, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """G7 for batched handlers: relay A is SIGKILLed inside a batch call that has written half of its
    batch; B takes the buckets over and applies the batch: every event exactly once, in order."""
    setup(dsn)
    pause_dir = tmp_path / "paused"
    pause_dir.mkdir()
    monkeypatch.setenv("OUTBOX_TEST_PAUSE_DIR", str(pause_dir))
    args = ["--no-kafka", *APP, "--projection", "ledger_batched", *FAST_RETRY]
    a = relays.start("a", dsn, "unused:9", "unused", args)
    keys = [f"key-{i:02d}" for i in range(20)]
    published = Published()
    Producers(dsn, "t", keys, 300, published, producers=2, rate=600).join()
    wait_until(lambda: applied_count(dsn, "batched_ledger") == 300, 60, 0.2, "relay A applying the first 300")

    from outbox_relay import Outbox
    with psycopg.connect(dsn) as conn:  # one transaction: one batch, the pause in its middle
        held = [Outbox(default_topic="t").publish(conn, type="acceptance.counted", key=f"held-{n % 3}",
                                                  payload={"key": f"held-{n % 3}", "n": n // 3 + 1,
                                                           "pause": 60.0 if n == 6 else 0})
                for n in range(12)]
    for k in range(3):
        published.add(f"held-{k}", [str(p.id) for n, p in enumerate(held) if n % 3 == k])
    wait_until(lambda: any(pause_dir.iterdir()), 30, 0.02, "A's handler to write half its batch and pause")
    a.signal(signal.SIGKILL)
    a.proc.wait(10)
    b = relays.start("b", dsn, "unused:9", "unused", args)
    more = Producers(dsn, "t", keys, 200, published, producers=2, rate=300)
    more.join()
    wait_until(lambda: applied_count(dsn, "batched_ledger") >= published.count(), 60, 0.2, "every event applied")
    time.sleep(0.5)
    assert applied_count(dsn, "batched_ledger") == published.count()
    rows = db_rows(dsn, "SELECT count(*), count(DISTINCT event_id) FROM batched_ledger")[0]
    assert rows[0] == rows[1], f"{rows[0] - rows[1]} events were applied more than once"
    by_key: dict[str, list[str]] = {}
    for event_id, key in db_rows(dsn, "SELECT event_id::text, key FROM batched_ledger ORDER BY id"):
        by_key.setdefault(key, []).append(event_id)
    assert by_key == published.by_key, "lost or out of order"
    held_pids = {pid for (pid,) in db_rows(dsn, "SELECT DISTINCT pid FROM batched_ledger WHERE key LIKE 'held-%'")}
    assert held_pids == {b.proc.pid}, "the killed relay's half batch landed"
    assert b.terminate() == 0


def test_kafka_and_two_projections_on_the_same_events_with_one_failing(
        dsn: str, relays: Relays, kafka_bootstrap: str, kafka_topic: str) -> None:
    """Each sink has its own progress: a projection whose handler fails for a while holds back
    neither Kafka nor the other projection, and catches up, in order and exactly once, afterwards."""
    setup(dsn)
    args = [*APP, "--projection", "ledger", "--projection", "flaky", "--max-attempts", "1000", *FAST_RETRY]
    for name in ("r1", "r2"):
        relays.start(name, dsn, kafka_bootstrap, kafka_topic, args)
    keys = [f"key-{i:02d}" for i in range(40)]
    published = Published()
    Producers(dsn, kafka_topic, keys, 2000, published, producers=2, rate=1500).join()

    wait_until(lambda: applied_count(dsn) == 2000, 90, 0.2, "the healthy projection to apply everything")
    records = read_topic(kafka_bootstrap, kafka_topic, 2000, timeout=60, settle=1.0)
    assert_delivered_in_order(published, records)
    assert applied_count(dsn, "flaky_ledger") == 0
    parked = db_rows(dsn, "SELECT count(*), count(DISTINCT partition_key) FROM outbox.parked WHERE sink = 'flaky'")[0]
    assert parked[0] > 0 and parked[1] <= len(keys), f"the failing projection's keys wait in the park: {parked}"
    assert db_rows(dsn, "SELECT count(*) FROM outbox.parked WHERE sink <> 'flaky'") == [(0,)]

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO switches VALUES ('flaky_ok')")  # downstream recovered
    wait_until(lambda: applied_count(dsn, "flaky_ledger") == 2000, 120, 0.3, "the failing projection catching up")
    assert_exactly_once_in_order(dsn, published, "flaky_ledger")
    assert_exactly_once_in_order(dsn, published, "ledger")
    assert db_rows(dsn, "SELECT count(*) FROM outbox.dead_letters") == [(0,)]
    lag = cli(dsn, "lag", "--sink", "flaky", "--json")
    assert lag.returncode == 0 and '"pending": 0' in lag.stdout, lag.stdout + lag.stderr
    for r in relays.started:
        assert r.terminate() == 0


def test_cli_rebuild_while_live_events_keep_arriving(dsn: str, relays: Relays) -> None:
    """G12 through the command: `outbox-relay rebuild` replays into fresh tables while a relay keeps
    applying new events, switches over, and the result is exactly once and in order."""
    setup(dsn)
    relay = relays.start("live", dsn, "unused:9", "unused", ["--no-kafka", *APP, "--projection", "ledger"])
    keys = [f"key-{i:02d}" for i in range(30)]
    published = Published()
    Producers(dsn, "t", keys, 3000, published, producers=2, rate=3000).join()
    wait_until(lambda: applied_count(dsn) == 3000, 60, 0.2, "live processing of the first 3000 events")

    stop = threading.Event()
    live_traffic = Producers(dsn, "t", keys, 10**9, published, producers=1, rate=150, stop=stop)
    try:
        result = cli(dsn, "rebuild", "ledger", *APP, "--batch-size", "200", timeout=180)
    finally:
        stop.set()
        live_traffic.join()
    assert result.returncode == 0, result.stderr
    assert "rebuilt 'ledger'" in result.stdout and "ev/s" in result.stderr, result.stdout + result.stderr
    wait_until(lambda: applied_count(dsn) == published.count(), 60, 0.2, "the live relay after the switch")
    assert_exactly_once_in_order(dsn, published)
    flags: dict[Any, int] = dict(db_rows(dsn, "SELECT replay, count(*) FROM ledger GROUP BY replay"))
    assert flags.get(True, 0) >= 3000, f"the rebuild's rows are marked as a replay: {flags}"
    assert relay.terminate() == 0


def interrupted_rebuild(dsn: str, marks: Path, sig: signal.Signals, *extra: str) -> tuple[int, str, str]:
    """`outbox-relay rebuild ledger` with a slow handler, sent ``sig`` while it replays: (exit code, out, err)."""
    marks.mkdir()
    env = {**os.environ, "OUTBOX_DSN": dsn, "OUTBOX_TEST_REPLAY_DELAY": "0.05", "OUTBOX_TEST_PAUSE_DIR": str(marks)}
    argv = [sys.executable, "-m", "outbox_relay.cli", "rebuild", "ledger", *APP, "--batch-size", "20", *extra]
    with subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as rebuild:
        try:
            wait_until(lambda: any(marks.iterdir()) or rebuild.poll() is not None, 60, 0.05, "the rebuild replaying")
            rebuild.send_signal(sig)
            out, err = rebuild.communicate(timeout=60)
        finally:
            rebuild.kill()
            rebuild.wait(30)
    return rebuild.returncode, out, err


def test_cli_rebuild_interrupted_exits_130_and_the_same_command_resumes(dsn: str, tmp_path: Path) -> None:
    """README's exit codes: `rebuild` stopped by SIGINT (Ctrl-C) or SIGTERM exits 130 saying how to resume;
    the same command then resumes and switches over, every event applied once."""
    setup(dsn)
    keys = [f"key-{i:02d}" for i in range(10)]
    published = Published()
    Producers(dsn, "t", keys, 400, published, producers=1, rate=100_000).join()
    for sig in (signal.SIGINT, signal.SIGTERM):
        code, out, err = interrupted_rebuild(dsn, tmp_path / sig.name, sig)
        assert code == 130, (sig.name, code, out, err)
        assert "interrupted; run the same command again to resume" in err, (sig.name, err)
    result = cli(dsn, "rebuild", "ledger", *APP, "--batch-size", "20", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "(resumed)" in result.stdout, result.stdout
    assert_exactly_once_in_order(dsn, published)
    # One key in place is one transaction: stopped, it changes nothing, and the same command does it all.
    for sig in (signal.SIGINT, signal.SIGTERM):
        code, out, err = interrupted_rebuild(dsn, tmp_path / f"key-{sig.name}", sig, "--key", keys[0])
        assert code == 130, (sig.name, code, out, err)
        assert "interrupted" in err, (sig.name, err)
        assert_exactly_once_in_order(dsn, published)
    result = cli(dsn, "rebuild", "ledger", *APP, "--key", keys[0], timeout=120)
    replayed = f"{len(published.by_key[keys[0]])} events replayed"
    assert result.returncode == 0 and replayed in result.stdout, result.stdout + result.stderr
    assert_exactly_once_in_order(dsn, published)
