"""An idle commit watcher (wakeups.py) looks less often and less deeply, and still wakes the owner of
the first commit after the quiet at once."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from outbox_relay import wakeups
from outbox_relay.services import listener as listener_module
from outbox_relay.wakeups import CommitWatcher
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import RecordingSink, make_settings, publish, running, settled
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


def test_a_quiet_watcher_backs_off_and_the_first_commit_brings_it_back(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A call returns after 20 ms without a commit (not 1 s): the back-off takes a fraction of a second.
    monkeypatch.setattr(wakeups, "WATCH_WAIT_MS", 20)
    calls: list[tuple[int, bool]] = []  # (interval of the call, whether it found commits)

    class Recording(CommitWatcher):
        def watch(self) -> str | None:
            interval = self.pace.interval_ms
            buckets = super().watch()
            calls.append((interval, buckets is not None))
            return buckets

    monkeypatch.setattr(listener_module, "CommitWatcher", Recording)
    sink = RecordingSink("relay-a")
    # Polling every 30 s: within this test only the watcher's notification wakes the runner.
    worker = Worker(make_settings(dsn, "relay-a", listen=True, poll_seconds=30.0, listen_poll_seconds=30.0,
                                  watch_interval_ms=1, watch_max_interval_ms=16), sinks=[sink])
    with running(worker):
        wait_until(lambda: settled(dsn, ["relay-a"]) and worker.watching, 15, message="the relay to watch")
        wait_until(lambda: [i for i, _ in calls[-2:]] == [16, 16], 15, message="the watcher to back off")
        assert [i for i, _ in calls[:5]] == [1, 1, 2, 4, 8], "doubled after each call that found nothing"
        before = len(calls)
        [event] = publish(dsn, [("key-1", "t", {})])
        wait_until(lambda: event in sink.delivered_ids(), 10, message="the owner to be woken")
        wait_until(lambda: any(found for _, found in calls[before:]), 10, message="the watcher to find it")
        found_at = next(n for n in range(before, len(calls)) if calls[n][1])
        wait_until(lambda: len(calls) > found_at + 1, 10, message="the next call")
    assert calls[found_at][0] == 16, "the commit was found by a look at the longest interval"
    assert calls[found_at + 1][0] == 1, "the first commit brought the shortest interval back"


def _index_scans(conn: psycopg.Connection[Any]) -> int:
    """Scans of the events indexes by this transaction (not yet flushed to pg_stat_*)."""
    (n,) = conn.execute("SELECT coalesce(sum(pg_stat_get_xact_numscans(i.indexrelid)), 0)::int "  # type: ignore[misc]
                        "FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid "
                        "JOIN pg_namespace s ON s.oid = c.relnamespace "
                        "WHERE s.nspname = 'outbox' AND c.relname LIKE 'events%'").fetchone()
    return int(n)


def test_an_idle_look_compares_snapshots_and_scans_nothing(dsn: str) -> None:
    """While no transaction with an id ends, a look (0022) is a snapshot comparison: fifty looks
    make no index scan; the first commit after them is still found."""
    with psycopg.connect(dsn) as conn, psycopg.connect(dsn) as other:
        other.execute("SELECT pg_current_xact_id()")  # open, with an id: nothing has ended while it stays
        (since,) = conn.execute("SELECT snapshot::text FROM outbox.watch_commits_v1(NULL, 0, 1)").fetchone()  # type: ignore[misc]
        scans = _index_scans(conn)
        row = conn.execute("SELECT snapshot::text, buckets FROM outbox.watch_commits_v1(%s::pg_snapshot, 50, 1)",
                           (since,)).fetchone()
        assert row == (since, None)
        assert _index_scans(conn) == scans, "an idle look scanned the events indexes"
        [event] = publish(dsn, [("key-1", "t", {})])
        row = conn.execute("SELECT buckets FROM outbox.watch_commits_v1(%s::pg_snapshot, 2000, 1)",
                           (since,)).fetchone()
        assert row is not None and row[0] is not None and event


def test_a_commit_while_a_call_sleeps_is_found_by_that_call(dsn: str) -> None:
    """The comparison sees the server's current snapshot at every look, not the one of the call's
    start: a commit made while a call waits is returned by that call, not left for its deadline."""
    result: list[Any] = []
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn, autocommit=True) as admin:
        (since,) = conn.execute("SELECT snapshot::text FROM outbox.watch_commits_v1(NULL, 0, 1)").fetchone()  # type: ignore[misc]
        pid = conn.info.backend_pid
        call = threading.Thread(target=lambda: result.append(conn.execute(
            "SELECT buckets FROM outbox.watch_commits_v1(%s::pg_snapshot, 30000, 8)", (since,)).fetchone()))
        call.start()
        wait_until(lambda: admin.execute("SELECT wait_event = 'PgSleep' FROM pg_stat_activity WHERE pid = %s",
                                         (pid,)).fetchone() == (True,), 10, message="the call to sleep")
        publish(dsn, [("key-1", "t", {})])
        call.join(60)
    assert result and result[0][0] is not None, "the call did not see the commit made while it slept"
