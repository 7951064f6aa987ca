"""``outbox-relay inbox run`` killed (SIGKILL, or a handler's ``os._exit``) and started again with the same
``--member-id`` (a StatefulSet, a systemd unit, an OOM-kill restart) or a new one: it resumes every
partition within the dead incarnation's lease plus a membership round and its start-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from outbox_relay.inbox import migrate_inbox
from outbox_relay.inbox.admin import list_dead_letters
from tests.acceptance.test_inbox_crash_loop import MAX_ATTEMPTS, Supervisor
from tests.integration.inbox_app import setup
from tests.integration.inbox_helpers import effects, produce_events, scalar
from tests.servers import wait_until

ROOT = Path(__file__).resolve().parents[2]
LEASE = 2.0
# The killed incarnation's lease runs out, the next membership round (every third of a lease) claims its
# partitions; plus the process's start-up (imports, connections, broker metadata) on a loaded machine.
BOUND = LEASE + LEASE / 3 + 8.0


def start(tmp: Path, member: str, dsn: str, bootstrap: str, topic: str,
          lease: float = LEASE) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OUTBOX_INBOX_DSN": dsn, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with (tmp / "consumer.log").open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox_relay.cli", "inbox", "run",
             "--handler", "tests.integration.inbox_app:handle", "--topic", topic,
             "--bootstrap-servers", bootstrap, "--member-id", member, "--lease-seconds", str(lease),
             "--verify-seconds", "3"],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def status(dsn: str) -> list[dict[str, object]]:
    done = subprocess.run([sys.executable, "-m", "outbox_relay.cli", "inbox", "status", "--dsn", dsn, "--json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    records: list[dict[str, object]] = json.loads(done.stdout)
    return records


@pytest.mark.parametrize("second_id", ["same", "new"])
def test_a_consumer_killed_mid_stream_resumes_every_partition_within_its_lease(
        database_factory: Callable[..., str], kafka_bootstrap: str, kafka_topic: str, tmp_path: Path,
        second_id: str) -> None:
    dsn = database_factory()
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate_inbox(conn)
        setup(conn)
    ids = produce_events(kafka_bootstrap, kafka_topic, [(f"k{i}", i % 4, {"n": i, "sleep": 0.02}) for i in range(120)])
    first = start(tmp_path, "pod-0", dsn, kafka_bootstrap, kafka_topic)
    try:
        wait_until(lambda: len(effects(dsn)) >= 20, 60, 0.05, "some applied before the kill")
        first.send_signal(signal.SIGKILL)  # inside a handler's transaction, most likely (each sleeps 20 ms)
        first.wait(10)
    finally:
        first.kill()
        first.wait(30)
    applied = len(effects(dsn))
    assert applied < 120
    member = "pod-0" if second_id == "same" else "pod-1"
    restarted = time.monotonic()
    second = start(tmp_path, member, dsn, kafka_bootstrap, kafka_topic)
    try:
        wait_until(lambda: len(effects(dsn)) > applied, BOUND + 20, 0.05, "the restarted consumer applies")
        resumed = time.monotonic() - restarted
        # Every partition, not only the ones the dead incarnation did not hold.
        wait_until(lambda: len(effects(dsn)) >= 120, 60, 0.1, "all 120 applied after the restart")
        assert resumed < BOUND, f"resumed {resumed:.1f}s after the restart (bound {BOUND:.1f}s)"
        wait_until(lambda: all(p["owner"] == member and p["state"] == "consuming" for p in status(dsn)), 10, 0.2,
                   "status: every partition consumed by the new incarnation")
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    finally:
        second.kill()
        second.wait(30)
        log = (tmp_path / "consumer.log").read_text(errors="replace")
    assert Counter(e[0] for e in effects(dsn)) == Counter(ids), "each exactly once:\n" + log[-3000:]
    print(f"{second_id} id: resumed {resumed:.2f}s after the restart (bound {BOUND:.1f}s)")


def test_a_message_that_kills_a_consumer_with_a_stable_member_id_is_dead_lettered(
        database_factory: Callable[..., str], kafka_bootstrap: str, kafka_topic: str, tmp_path: Path) -> None:
    """The supervisor restarts the consumer with the same --member-id after each os._exit: the message's
    attempts count across the restarts, it lands in the dead letters, its partition and the others go on."""
    dsn = database_factory()
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate_inbox(conn)
        setup(conn)
    before = produce_events(kafka_bootstrap, kafka_topic, [("k", 0, {"n": 0}), ("o", 1, {"n": 1})])
    [killer] = produce_events(kafka_bootstrap, kafka_topic, [("k", 0, {"exit": True})])
    after = produce_events(kafka_bootstrap, kafka_topic, [("k", 0, {"n": 2}), ("o", 1, {"n": 3}), ("p", 2, {"n": 4})])
    supervisor = Supervisor(tmp_path, dsn, kafka_bootstrap, kafka_topic, member="consumer-0")
    try:
        supervisor.until(lambda: scalar(dsn, "SELECT count(*) FROM outbox_inbox.dead_letters") == 1, 60,
                         "the killer message in the dead letters")
        supervisor.until(lambda: len(effects(dsn)) == 5, 30, "its partition went on")
        with psycopg.connect(dsn, autocommit=True) as conn:
            [dead] = list_dead_letters(conn, "inbox")
        assert (dead["message_id"], dead["attempts"]) == (killer, MAX_ATTEMPTS)
        assert MAX_ATTEMPTS + 1 <= supervisor.deaths <= MAX_ATTEMPTS + 2, supervisor.deaths
    finally:
        supervisor.stop()
    assert Counter(e[0] for e in effects(dsn)) == Counter(before + after), "each exactly once"


def test_a_paused_holder_with_the_same_member_id_is_waited_out_and_fenced(
        database_factory: Callable[..., str], kafka_bootstrap: str, kafka_topic: str, tmp_path: Path) -> None:
    """A holder that is alive (here: SIGSTOP; or on another host) is not taken over at once: the new run
    under its id waits for its leases to run out (``inbox status`` says so), then claims them; the old
    run, resumed, finds them gone, applies nothing, and its stop releases nothing of the new run's."""
    dsn = database_factory()
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate_inbox(conn)
        setup(conn)
    lease = 8.0  # longer than the new run's start-up: it finds the old leases running
    first = start(tmp_path, "pod-0", dsn, kafka_bootstrap, kafka_topic, lease)
    second: subprocess.Popen[bytes] | None = None
    try:
        wait_until(lambda: [p["state"] for p in status(dsn)] == ["consuming"] * 4, 60, 0.2, "the first run holds all")
        first.send_signal(signal.SIGSTOP)
        paused = time.monotonic()
        second = start(tmp_path, "pod-0", dsn, kafka_bootstrap, kafka_topic, lease)
        waiting = wait_until(lambda: [p for p in status(dsn) if p["state"] == "waiting for previous run"], 30, 0.1,
                             "status: waiting for the previous run's leases")
        assert "did not release it" in str(waiting[0]["detail"]), waiting
        wait_until(lambda: [p["state"] for p in status(dsn)] == ["consuming"] * 4, lease + lease / 3 + 10, 0.1,
                   "the new run holds all after the old leases ran out")
        took = time.monotonic() - paused
        ids = produce_events(kafka_bootstrap, kafka_topic, [(f"k{i}", i % 4, {"n": i}) for i in range(20)])
        wait_until(lambda: len(effects(dsn)) == 20, 30, 0.1, "the new run applies")
        first.send_signal(signal.SIGCONT)
        log = tmp_path / "consumer.log"
        wait_until(lambda: "also used by another live process" in log.read_text(errors="replace"), 30, 0.2,
                   "the clash is logged")
        more = produce_events(kafka_bootstrap, kafka_topic, [(f"k{i}", i % 4, {"n": i}) for i in range(20)])
        wait_until(lambda: len(effects(dsn)) == 40, 30, 0.1, "applied while both run")
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0
        # The leases themselves: the old run's stop ended none of the new run's. (Its registration under
        # the shared id goes with it, so `state` reads the new run's leases as a previous run's until the
        # new run's next heartbeat, a third of a lease later.)
        held = status(dsn)
        assert [(p["owner"], p["leased"]) for p in held] == [("pod-0", True)] * 4, \
            f"the old run's stop ended the new run's leases: {held}"
        wait_until(lambda: [p["state"] for p in status(dsn)] == ["consuming"] * 4, lease / 3 + 10, 0.2,
                   "status: the new run's heartbeat registers it again")
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
        assert [p["state"] for p in status(dsn)] == ["free"] * 4
    finally:
        for process in (first, second):
            if process is not None:
                process.kill()
                process.wait(30)
    assert Counter(e[0] for e in effects(dsn)) == Counter(ids + more), "each exactly once"
    print(f"paused holder: taken over {took:.2f}s after it stopped (lease {lease:g}s)")
