"""A rebuild never builds an incomplete model silently (G12): retention that removes history while a
rebuild starts either waits for its hold or is seen by its check, which refuses before anything swaps.
The window is widened deterministically: another session holds the projection's table (as ALTER TABLE
or VACUUM FULL would), so the start waits with its sink not yet committed, and retention runs then.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay.housekeeping import Housekeeping
from projections.rebuild import Rebuild, RebuildError
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    close_history,
    fetch_all,
    make_settings,
    pool_fixture,
    publish,
    run_until,
)
from tests.integration.test_rebuild import (  # noqa: F401  (the `live` fixture)
    applied_ids,
    live,
    orders,
    rebuild_settings,
    state,
    totals_projection,
)

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


def until(condition: Callable[[], Any], timeout: float = 60.0) -> None:
    """Poll a condition of the database (nothing else signals it) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        threading.Event().wait(0.05)


def waits_for(dsn: str, table: str) -> bool:
    return bool(fetch_all(dsn, "SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                               "WHERE c.relname = %s AND NOT l.granted", (table,)))


def complete(dsn: str, capsys: pytest.CaptureFixture[str]) -> Any:
    from outbox_relay import cli

    capsys.readouterr()
    assert cli.main(["status", "--json", "--dsn", dsn]) == cli.EXIT_OK
    [row] = json.loads(capsys.readouterr().out)["history"]
    return row["full_rebuild_complete"]


def test_retention_while_a_rebuild_start_waits_on_the_projections_table_is_refused_not_swapped_in(
        dsn: str, live: Any, pool: ConnectionPool[Any], capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    first = publish(dsn, orders(3, 2))
    runner = live(totals_projection())
    run_until(runner, lambda: len(applied_ids(dsn)) == len(first))
    close_history(dsn)  # the first events' partition may go once every sink passed it
    later = publish(dsn, orders(3, 1, start=2))
    run_until(runner, lambda: len(applied_ids(dsn)) == len(first) + len(later))
    live_state = state(dsn)
    assert complete(dsn, capsys) is True
    outcome: list[Any] = []

    def rebuild() -> None:
        try:
            outcome.append(Rebuild(totals_projection(), rebuild_settings(dsn), progress=None).run())
        except RebuildError as exc:
            outcome.append(exc)

    with psycopg.connect(dsn) as holder:
        holder.execute("LOCK TABLE order_totals IN ACCESS EXCLUSIVE MODE")  # as ALTER TABLE or VACUUM FULL
        thread = threading.Thread(target=rebuild)
        thread.start()
        try:
            until(lambda: waits_for(dsn, "order_totals"))  # the start waits, its sink not committed
            removed = Housekeeping(pool, make_settings(dsn, "hk", retention_seconds=0.0))._apply_retention()
            assert removed == len(first), "retention removed the partition the rebuild needs"
        finally:
            holder.rollback()
            thread.join(120)

    [result] = outcome
    assert isinstance(result, RebuildError), f"the rebuild swapped in a model without {len(first)} events: {result}"
    assert "would be partial" in str(result) and "--accept-partial" in str(result)
    assert state(dsn) == live_state, "a refused rebuild changes nothing"
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.rebuilds") == [(0,)]
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.sinks WHERE name LIKE '%%.rebuild'") == [(0,)]
    assert fetch_all(dsn, "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'outbox_rebuild_%%'") == [(0,)]
    assert complete(dsn, capsys) is False, "status must not say complete: retention removed applied events"


def test_the_rebuild_holds_retention_once_started(dsn: str, live: Any, pool: ConnectionPool[Any]) -> None:  # noqa: F811
    """After its start, the rebuild's sink holds the history it has still to replay: retention removes
    nothing of it, and the rebuild replays every event."""
    first = publish(dsn, orders(3, 2))
    runner = live(totals_projection())
    run_until(runner, lambda: len(applied_ids(dsn)) == len(first))
    close_history(dsn)
    live_state = state(dsn)
    r = Rebuild(totals_projection(), rebuild_settings(dsn), progress=None)
    with psycopg.connect(dsn, autocommit=True) as conn:
        r._start(conn)  # the start alone, then retention, then the rest
    assert Housekeeping(pool, make_settings(dsn, "hk", retention_seconds=0.0))._apply_retention() == 0
    result = Rebuild(totals_projection(), rebuild_settings(dsn), progress=None).run()
    assert result is not None and result.resumed and result.events == len(first)
    assert state(dsn) == live_state


def test_a_removal_that_looked_before_the_rebuild_registered_looks_again_before_it_drops(
        dsn: str, live: Any) -> None:  # noqa: F811
    """Retention looked at a leaf (nothing held it) before the rebuild's sink committed, and then waited for the
    leaf (a reader held it). It looks again under the leaf's lock, sees the rebuild's hold and keeps the leaf;
    the rebuild's check waited for it and replays every event. Without the second look the leaf went, and the
    rebuild could only refuse."""
    first = publish(dsn, orders(3, 2))
    runner = live(totals_projection())
    run_until(runner, lambda: len(applied_ids(dsn)) == len(first))
    close_history(dsn)
    later = publish(dsn, orders(3, 1, start=2))
    run_until(runner, lambda: len(applied_ids(dsn)) == len(first) + len(later))
    live_state = state(dsn)
    [(leaf,)] = fetch_all(dsn, "SELECT tableoid::regclass::text FROM outbox.events WHERE id = %s", (first[0],))
    pids: list[int] = []
    removal: list[Any] = []
    outcome: list[Any] = []

    def remove() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE outbox.housekeeping SET default_keep = interval '0'")  # as a pass with a 0 keep
            pids.append(conn.info.backend_pid)
            removal.extend(conn.execute("SELECT leaf FROM outbox.retire_partition_v2()").fetchall())

    def rebuild() -> None:
        try:
            outcome.append(Rebuild(totals_projection(), rebuild_settings(dsn), progress=None).run())
        except (RebuildError, psycopg.Error) as exc:
            outcome.append(exc)

    def waiting(others: bool) -> bool:
        """The removal (or, ``others``, another session than it) waits for a lock."""
        return bool(fetch_all(dsn, "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
                                   "AND wait_event_type = 'Lock' AND (pid = %s) <> %s", (pids[0], others)))

    with psycopg.connect(dsn) as reader:
        reader.execute(f"SELECT count(*) FROM {leaf}").fetchone()  # holds the leaf (ACCESS SHARE)
        remover, rebuilder = threading.Thread(target=remove), threading.Thread(target=rebuild)
        remover.start()
        try:
            until(lambda: bool(pids) and waiting(False))  # the removal looked (no hold) and waits for the leaf
            rebuilder.start()
            until(lambda: waiting(True))  # the rebuild's sink committed; its check waits behind the removal
        finally:
            reader.rollback()
            remover.join(60)
            if rebuilder.ident is not None:
                rebuilder.join(120)

    assert removal == [], f"retention removed {leaf}, which the rebuild's sink held"
    [result] = outcome
    assert not isinstance(result, BaseException), result
    assert result is not None and result.events == len(first) + len(later)
    assert state(dsn) == live_state
