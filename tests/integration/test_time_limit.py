"""Issue 26: one time limit for every handler the engine calls, with one cap on abandoned threads per
process (outbox_relay/timelimit.py): a projection's abandoned walk and a user sink's abandoned call are
counted together, so the process stops at the cap whichever of them left the threads."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import store, timelimit
from outbox_relay.errors import SinkStuck
from outbox_relay.relay import SinkRunner
from outbox_relay.sinks import SinkEvent
from outbox_relay.sinks.adapter import EventSinkAdapter
from projections import ProjectionEvent, projection
from projections.sink import ProjectionSink
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    ALL_BUCKETS,
    dead_letters,
    make_settings,
    pool_fixture,
    publish,
    release_fixture,
    run_until,
    runner_for,
)
from tests.servers import wait_until


class HangingSink:
    """A user sink whose call for key ``sink-stuck`` never returns (until ``release``)."""

    name = "audit"
    kind = "audit"

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def deliver(self, event: SinkEvent) -> None:
        if event.key == "sink-stuck":
            self.release.wait()


def test_a_projection_and_a_user_sink_share_one_cap_of_abandoned_threads(
        dsn: str, pool: ConnectionPool[Any], release: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = publish(dsn, [("sink-stuck", "OrderPlaced", {}), ("projection-stuck", "OrderPlaced", {})])
    # Room for one more abandoned thread in this process: the user sink takes it, the projection's crosses.
    monkeypatch.setattr(timelimit, "MAX_ABANDONED", timelimit.abandoned_threads() + 1)

    adapter = EventSinkAdapter(HangingSink(release), handler_timeout_seconds=0.5)
    user = runner_for(adapter, pool, make_settings(dsn, "w", max_attempts=1, handler_timeout_seconds=0.5))
    try:
        run_until(user, lambda: ids[0] in dead_letters(dsn, "audit"), timeout=30)
        assert user.fatal is None, "one abandoned call is within the cap"
    finally:
        adapter.close()

    def handler(event: ProjectionEvent[Any], tx: Any) -> None:
        if event.key == "projection-stuck":
            release.wait()

    sink = ProjectionSink(projection("capped", events=["OrderPlaced"])(handler), dsn, handler_timeout_seconds=0.5)
    with pool.connection() as conn:
        store.register_sink(conn, sink.name, sink.kind)
    r = SinkRunner(sink, pool, make_settings(dsn, "w", max_attempts=1, handler_timeout_seconds=0.5))
    r.desired = set(ALL_BUCKETS)
    loop = threading.Thread(target=r.run, daemon=True)
    loop.start()
    try:
        # With a cap per module the projection's one abandoned walk is within its own cap: it would
        # dead-letter the event and go on.
        wait_until(lambda: not loop.is_alive(), 30, 0.05, "the projection's runner stopping at the process's cap")
        assert isinstance(r.fatal, SinkStuck), r.fatal
        assert "more than" in str(r.fatal), r.fatal
        # The abandoned call was charged (and landed) before it stopped.
        dead = dead_letters(dsn, "capped")
        assert list(dead) == [ids[1]] and dead[ids[1]][0] == 1 and "did not return within" in dead[ids[1]][1], dead
    finally:
        r.draining.set()
        loop.join(10)
        sink.close()
