"""The worker registry against what operators get wrong: two relays given one --worker-id (the second is
refused while the first one's heartbeat is fresh; a restart after a crash is not), and relays with
different --heartbeat-seconds / --worker-ttl-seconds (each judged by its own TTL: no reassignment churn,
nobody declared dead)."""

from __future__ import annotations

import json
import os
import socket
import threading
from typing import Any

import psycopg
import pytest

from outbox_relay import cli, store
from outbox_relay.errors import WorkerIdInUse
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import SINK, RecordingSink, fetch_all, make_settings, register, running, settled
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


def meta(instance: str, host: str = "elsewhere", pid: int = 4242, ttl: float = 10.0) -> dict[str, Any]:
    return {"instance": instance, "host": host, "pid": pid, "ttl_seconds": ttl}


def test_a_fresh_registration_of_another_instance_is_not_overwritten(dsn: str) -> None:
    register(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert store.heartbeat(conn, "twin", "alive", [SINK], meta("a"), ttl=10.0)
        with pytest.raises(WorkerIdInUse) as clash:
            store.heartbeat(conn, "twin", "alive", [SINK], meta("b", host="other-host", pid=7), ttl=10.0)
        assert (clash.value.host, clash.value.pid) == ("elsewhere", 4242), clash.value
        assert 0 < clash.value.seconds_left <= 10.0
        [row] = fetch_all(dsn, "SELECT metadata ->> 'instance' FROM outbox.workers WHERE id = 'twin'")
        assert row[0] == "a", "the first relay's registration stands"
        # Once the first one's heartbeat is older than its own TTL, the id is free to take.
        conn.execute("UPDATE outbox.workers SET last_seen_at = clock_timestamp() - interval '11 seconds'")
        assert store.heartbeat(conn, "twin", "alive", [SINK], meta("b", host="other-host", pid=7), ttl=10.0)
        # A relay that lost its id does not remove the new owner's registration when it leaves.
        store.leave(conn, "twin", "a")
        assert fetch_all(dsn, "SELECT count(*) FROM outbox.workers WHERE id = 'twin'") == [(1,)]


def test_a_second_relay_with_the_same_id_is_refused_and_status_shows_it(dsn: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """In one process both relays have the same host and pid, so the first one's registration is made to
    look like another host's (as two hosts with one --worker-id are)."""
    register(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert store.heartbeat(conn, "twin", "alive", [SINK], meta("first"), ttl=10.0)
    second = Worker(make_settings(dsn, "twin"), [RecordingSink("second")])
    with pytest.raises(WorkerIdInUse) as refused:
        second.run(install_signals=False)
    message = str(refused.value)
    assert "twin" in message and "elsewhere" in message and "4242" in message, message
    assert fetch_all(dsn, "SELECT metadata ->> 'instance', metadata -> 'clash' ->> 'host' FROM outbox.workers") == [
        ("first", socket.gethostname())], "the refusal is recorded on the registration (status shows it)"
    assert cli.main(["status", "--dsn", dsn, "--json"]) == cli.EXIT_OK
    [row] = json.loads(capsys.readouterr().out)["workers"]
    assert (row["host"], row["pid"]) == ("elsewhere", 4242), row
    refused_here = f"refused a second relay on host {socket.gethostname()} (pid {os.getpid()}) at "
    assert row["clash"].startswith(refused_here), row
    assert cli.main(["status", "--dsn", dsn]) == cli.EXIT_OK
    assert "refused a second relay on host" in capsys.readouterr().out


def test_a_relay_restarted_after_a_crash_takes_its_id_back_at_once(dsn: str) -> None:
    """Same host, and the pid that registered is gone (or is this very process: a container's pid 1):
    the registration is a previous run's, not a second relay's."""
    register(dsn)
    gone = 2 ** 22 + 17  # above pid_max: no such process
    with psycopg.connect(dsn, autocommit=True) as conn:
        for instance, pid in (("crashed", gone), ("pid-1", os.getpid())):
            conn.execute("DELETE FROM outbox.workers")
            assert store.heartbeat(conn, "again", "alive", [SINK], meta(instance, socket.gethostname(), pid, 600.0))
            worker = Worker(make_settings(dsn, "again"), [RecordingSink("again")])
            with running(worker):
                wait_until(lambda: settled(dsn, ["again"]), 20, message="the restarted relay to take its buckets")


def generation(dsn: str) -> tuple[int, int, list[str]]:
    """(assignment generation, sum of fences, workers marked dead)."""
    [(gen,)] = fetch_all(dsn, "SELECT generation FROM outbox.assignments WHERE sink = %s", (SINK,))
    [(fences,)] = fetch_all(dsn, "SELECT sum(fence)::bigint FROM outbox.cursors WHERE sink = %s", (SINK,))
    dead = [r[0] for r in fetch_all(dsn, "SELECT id FROM outbox.workers WHERE status = 'dead'")]
    return int(gen), int(fences), dead


def test_relays_with_different_heartbeat_settings_do_not_churn(dsn: str) -> None:
    """A fast relay (beat 0.1 s, TTL 0.4 s) beside a slow one (beat 1 s, TTL 3 s), as in a rolling change
    of the settings: the fast one judges the slow one by the slow one's own TTL."""
    fast = Worker(make_settings(dsn, "fast", heartbeat_seconds=0.1, worker_ttl_seconds=0.4,
                                housekeeping_seconds=0.2), [RecordingSink("fast")])
    slow = Worker(make_settings(dsn, "slow", heartbeat_seconds=1.0, worker_ttl_seconds=3.0), [RecordingSink("slow")])
    with running(slow), running(fast):
        wait_until(lambda: settled(dsn, ["fast", "slow"]), 30, message="both relays to share the buckets")
        before = generation(dsn)
        beats: set[Any] = set()

        def slow_beats() -> bool:  # each gap between two of them is longer than the fast relay's TTL
            beats.update(r[0] for r in fetch_all(dsn, "SELECT last_seen_at FROM outbox.workers WHERE id = 'slow'"))
            return len(beats) >= 6

        wait_until(slow_beats, 30, 0.05, "five heartbeats of the slow relay")
        after = generation(dsn)
    assert after == before, f"(generation, fences, dead) went from {before} to {after}"


def test_a_relay_whose_id_was_taken_while_it_was_silent_stops(dsn: str) -> None:
    """Its heartbeats lapsed past its TTL (a partition, SIGSTOP) and another process registered the id:
    when it is heard from again it stops (exit 2 under `run`), leaving the other's registration alone."""
    worker = Worker(make_settings(dsn, "lapsed"), [RecordingSink("lapsed")])
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    thread.start()
    try:
        wait_until(lambda: settled(dsn, ["lapsed"]), 20, message="the relay to take its buckets")
        with psycopg.connect(dsn, autocommit=True) as conn:  # what the newcomer's registration looks like
            conn.execute("UPDATE outbox.workers SET metadata = %s, last_seen_at = clock_timestamp() "
                         "WHERE id = 'lapsed'", (json.dumps(meta("newcomer", ttl=60.0)),))
        thread.join(30)
        assert not thread.is_alive(), "the relay whose id was taken kept running"
    finally:
        worker.stop_hard()
        thread.join(30)
    assert isinstance(worker.fatal, WorkerIdInUse) and "elsewhere" in str(worker.fatal), worker.fatal
    assert fetch_all(dsn, "SELECT metadata ->> 'instance' FROM outbox.workers WHERE id = 'lapsed'") == [("newcomer",)]
