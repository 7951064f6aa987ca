"""Acceptance (issue 15): real ``outbox-relay run`` processes whose projection handler never returns.

Every other key keeps flowing, the stuck event is charged and dead-lettered, and the process still
stops within its documented bound: ``--drain-seconds`` then at most ``HARD_STOP_SECONDS`` on SIGTERM,
``HARD_STOP_SECONDS`` after a second signal, exit 0 when every sink thread returned and
``EXIT_HARD_STOP`` (5) when one was left blocked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import pytest

from outbox_relay import Outbox
from outbox_relay.worker import EXIT_HARD_STOP, HARD_STOP_SECONDS
from tests.acceptance.projection_app import SCHEMA
from tests.acceptance.test_relay_processes import Relay, Relays, db_rows
from tests.servers import wait_until

pytestmark = pytest.mark.slow

APP = ["--no-kafka", "--projections", "tests.acceptance.projection_app", "--projection", "blocking",
       "--backoff-base-seconds", "0.1", "--backoff-max-seconds", "0.5"]
SLACK = 15.0  # process start-up and a loaded machine: the bound is checked generously, never as a timing


def publish(dsn: str, events: list[tuple[str, int, bool]]) -> list[str]:
    with psycopg.connect(dsn) as conn:
        outbox = Outbox(default_topic="t")
        return [str(outbox.publish(conn, type="acceptance.counted", key=key,
                                   payload={"key": key, "n": n, "block": b}).id)
                for key, n, b in events]


def applied(dsn: str) -> set[str]:
    return {r[0] for r in db_rows(dsn, "SELECT event_id::text FROM blocking_ledger")}


def start(relays: Relays, dsn: str, name: str, *args: str) -> Relay:
    return relays.start(name, dsn, "unused:9", "unused", [*APP, *args])


@pytest.fixture(name="pause_dir")
def pause_dir_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the blocking handler marks each call that blocked (the relays inherit the variable)."""
    path = tmp_path / "entered"
    path.mkdir()
    monkeypatch.setenv("OUTBOX_TEST_PAUSE_DIR", str(path))
    return path


def setup(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)


def test_a_handler_that_never_returns_holds_back_only_its_key_and_sigterm_still_ends_the_relay(
        dsn: str, relays: Relays, pause_dir: Path) -> None:
    """The issue's probe: one event whose handler blocks forever and 30 events of other keys. Before, 0 of
    the 30 were applied in 90 s and only SIGKILL ended the relay."""
    setup(dsn)
    relay = start(relays, dsn, "r", "--handler-timeout-seconds", "2", "--max-attempts", "2", "--drain-seconds", "3")
    stuck = publish(dsn, [("stuck", 1, True), ("stuck", 2, False)])
    others = publish(dsn, [(f"key-{i:02d}", 1, False) for i in range(30)])
    wait_until(lambda: applied(dsn) >= set(others), 60, 0.2, "every other key applied")
    wait_until(lambda: db_rows(dsn, "SELECT attempts, last_error FROM outbox.dead_letters WHERE event_id = %s",
                               (stuck[0],)), 60, 0.2, "the stuck event dead-lettered")
    [(attempts, error)] = db_rows(dsn, "SELECT attempts, last_error FROM outbox.dead_letters WHERE event_id = %s",
                                  (stuck[0],))
    assert attempts == 2 and "did not return within 2s" in error, error
    wait_until(lambda: stuck[1] in applied(dsn), 30, 0.2, "the stuck key's next event applied after its head")
    assert applied(dsn) == {stuck[1], *others}

    # A handler blocked right now: SIGTERM drains for --drain-seconds, then stops hard and exits.
    publish(dsn, [("stuck-again", 1, True)])
    wait_until(lambda: len(list(pause_dir.glob("*"))) >= 3, 30, 0.1, "the handler blocked again")
    relay.signal(signal.SIGTERM)
    try:
        code = relay.proc.wait(3 + HARD_STOP_SECONDS + SLACK)
    except subprocess.TimeoutExpired:
        pytest.fail("the relay did not exit within --drain-seconds + HARD_STOP_SECONDS of SIGTERM")
    assert code == 0, relay.tail()
    assert db_rows(dsn, "SELECT count(*) FROM outbox.cursors WHERE sink = 'blocking' AND owner IS NOT NULL") == [(0,)]


def test_a_second_signal_stops_hard_within_its_bound(dsn: str, relays: Relays, pause_dir: Path) -> None:
    """The second signal does not wait for --drain-seconds (600 here), even with a handler blocked
    (whose own limit, 600 s, is far away): the batch is abandoned, the leases released, exit 0."""
    setup(dsn)
    relay = start(relays, dsn, "r", "--handler-timeout-seconds", "600", "--drain-seconds", "600")
    publish(dsn, [("stuck", 1, True)])
    wait_until(lambda: any(pause_dir.glob("*")), 30, 0.1, "the handler blocked")
    relay.signal(signal.SIGTERM)
    wait_until(lambda: "draining" in relay.stderr().lower(), 10, 0.1, "the relay draining")
    assert relay.running, "a drain waits for the batch in flight"
    relay.signal(signal.SIGTERM)
    try:
        code = relay.proc.wait(HARD_STOP_SECONDS + SLACK)
    except subprocess.TimeoutExpired:
        pytest.fail("the relay did not exit within HARD_STOP_SECONDS of the second signal")
    assert code == 0, relay.tail()
    assert "stopping hard" in relay.stderr()
    assert db_rows(dsn, "SELECT count(*) FROM outbox.cursors WHERE sink = 'blocking' AND owner IS NOT NULL") == [(0,)]


BLOCKING_SINK = """
import sys, threading
from outbox_relay.settings import RelaySettings
from outbox_relay.worker import Worker

class Blocking:
    name, kind, event_filter = "blocky", "projection", None

    def deliver(self, events, fences, commit, abort):
        print("blocked", flush=True)
        threading.Event().wait()  # never checks abort: a thread Python can not stop

    def close(self):
        pass

settings = RelaySettings(dsn=sys.argv[1], worker_id="blocky", kafka=False, listen=False, drain_seconds=1,
                         heartbeat_seconds=0.5, worker_ttl_seconds=2, poll_seconds=0.1)
Worker(settings, [Blocking()]).run()
"""


def test_a_sink_thread_that_never_returns_ends_the_process_with_exit_5(dsn: str, tmp_path: Path) -> None:
    """A sink that never returns and never checks its stop flag (no guard can abandon it): SIGTERM drains
    for --drain-seconds, stops hard, and HARD_STOP_SECONDS later the process exits EXIT_HARD_STOP, its
    leases released."""
    publish(dsn, [("k", 1, False)])
    script = tmp_path / "blocking_sink.py"
    script.write_text(textwrap.dedent(BLOCKING_SINK))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with subprocess.Popen([sys.executable, str(script), dsn], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "blocked"
            proc.send_signal(signal.SIGTERM)
            try:
                _, err = proc.communicate(timeout=1 + HARD_STOP_SECONDS + SLACK)
            except subprocess.TimeoutExpired:
                pytest.fail("the process did not exit within --drain-seconds + HARD_STOP_SECONDS of SIGTERM")
            assert proc.returncode == EXIT_HARD_STOP, err
            assert "still blocked" in err, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    assert db_rows(dsn, "SELECT count(*) FROM outbox.cursors WHERE sink = 'blocky' AND owner IS NOT NULL") == [(0,)]
    assert db_rows(dsn, "SELECT count(*) FROM outbox.workers WHERE id = 'blocky'") == [(0,)]
