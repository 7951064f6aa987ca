"""The contract kit's harness (``SinkContract``): one test's database, its sink with the planned answers in
front of it, the real runners that drive it, and probes of what landed."""

from __future__ import annotations

import atexit
import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import ConnectionPool

from .. import store
from ..publish import Outbox
from ..relay import SinkRunner
from ..settings import load_settings
from ..sinks.adapter import EventSinkAdapter
from ..sinks.engine import is_engine_sink
from .sink_faults import FaultyEngineSink, Plan, Recorder, faulty_event_sink

if TYPE_CHECKING:
    from .sink_contract import SinkContract

_server: Any = None  # the private PostgreSQL of this process, when the kit started one


def server_dsn() -> str:
    """A server where the kit may create databases: OUTBOX_TEST_DSN, else a private PostgreSQL 18."""
    import os

    given = os.environ.get("OUTBOX_TEST_DSN")
    if given:
        return given
    global _server
    if _server is None:
        from ..embedded import EmbeddedPostgres

        _server = EmbeddedPostgres().start()
        atexit.register(_server.stop)
    return str(_server.dsn)


@contextlib.contextmanager
def fresh_database(server: str) -> Iterator[str]:
    name = f"sink_contract_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(server, dbname=name)
    try:
        yield dsn
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class Harness:
    """One test's database, sink (with the kit's planned failures in front of it) and runners."""

    def __init__(self, suite: SinkContract, dsn: str) -> None:
        self.suite, self.dsn = suite, dsn
        self.sink = suite.make_sink()
        self.engine = is_engine_sink(self.sink)
        self.plan = Plan()
        self.recorder = Recorder()
        self.custom_received = False
        self.faulty: Any = (FaultyEngineSink if self.engine else faulty_event_sink)(self.sink, self.plan, self.recorder)
        self.pool: ConnectionPool[Any] = ConnectionPool(dsn, min_size=1, max_size=4, open=True,
                                                        kwargs={"autocommit": True})
        self.adapter: EventSinkAdapter | None = None

    def close(self) -> None:
        self.plan.release.set()
        with contextlib.suppress(Exception):
            (self.adapter or self.faulty).close()
        self.pool.close()

    def name(self) -> str:
        return str(self.sink.name)

    # -- publishing and running -----------------------------------------------------------

    def publish(self, *, keys: int, per_key: int, transactions: int = 1) -> dict[str, list[uuid.UUID]]:
        """``per_key`` events for each of ``keys`` keys, interleaved, in ``transactions`` transactions."""
        outbox = Outbox(default_topic=self.suite.topic)
        rows = [(f"k{k}", n) for n in range(per_key) for k in range(keys)]
        out: dict[str, list[uuid.UUID]] = defaultdict(list)
        step = max(1, -(-len(rows) // transactions))
        with psycopg.connect(self.dsn) as conn:
            for start in range(0, len(rows), step):
                with conn.transaction():
                    published = outbox.publish_many(conn, [
                        {"key": key, "type": self.suite.event_type, "payload": {"key": key, "n": n}}
                        for key, n in rows[start:start + step]])
                for (key, _), p in zip(rows[start:start + step], published, strict=True):
                    out[key].append(p.id)
        return dict(out)

    def runner(self, *, worker_id: str = "contract", max_attempts: int = 10,
               handler_timeout_seconds: float = 30.0) -> SinkRunner:
        settings = load_settings(
            dsn=self.dsn, worker_id=worker_id, kafka=False, listen=False, poll_seconds=0.05,
            backoff_base_seconds=0.01, backoff_max_seconds=0.05, max_attempts=max_attempts,
            handler_timeout_seconds=handler_timeout_seconds, heartbeat_seconds=0.2, worker_ttl_seconds=1.0,
            # Cursors written with each batch, so that a settle sees them at once: a runner would defer them
            # (up to a second, or cursor_flush_seconds while vacuum is held back; test_cursor_writes.py).
            cursor_flush_seconds=0)
        sink = self.faulty
        if not self.engine:  # one adapter per test (its close closes the user's sink), its limit per runner
            self.adapter = self.adapter or EventSinkAdapter(self.faulty)
            self.adapter.timeout = handler_timeout_seconds
            sink = self.adapter
        with self.pool.connection() as conn:
            store.register_sink(conn, sink.name, sink.kind)
        runner = SinkRunner(sink, self.pool, settings)
        runner.desired = set(range(256))
        return runner

    def run_until(self, runner: SinkRunner, predicate: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.suite.settle_seconds
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"sink {self.name()}: not reached within {self.suite.settle_seconds:g}s: "
                                     f"parked {self.parked()}, dead letters {self.dead_letters()}, "
                                     f"{self.undelivered()} undelivered")
            runner.run_once()
            time.sleep(0.01)

    def run_until_settled(self, runner: SinkRunner) -> None:
        """Until nothing of the sink is undelivered or parked."""
        self.run_until(runner, lambda: self.undelivered() == 0 and not self.parked())

    def crash_before_checkpoint(self, cursors: list[tuple[Any, ...]]) -> None:
        """As if the relay died after delivering and before its checkpoints: the cursors go back to
        ``cursors`` and the leases are free (the next relay takes over with a new fence)."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for bucket, snapshot, target, after_xid, after_seq in cursors:
                conn.execute("UPDATE outbox.cursors SET snapshot = %s::pg_snapshot, target = %s::pg_snapshot, "
                             "after_xid = %s::xid8, after_seq = %s, owner = NULL, lease_expires_at = NULL "
                             "WHERE sink = %s AND bucket = %s",
                             (snapshot, target, after_xid, after_seq, self.name(), bucket))

    # -- probes ---------------------------------------------------------------------------

    def _rows(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return list(conn.execute(query, params).fetchall())

    def cursors(self) -> list[tuple[Any, ...]]:
        return self._rows("SELECT bucket, snapshot::text, target::text, after_xid::text, after_seq "
                          "FROM outbox.cursors WHERE sink = %s", [self.name()])

    def undelivered(self) -> int:
        rows = self._rows("SELECT count(*) FROM outbox.events e JOIN outbox.cursors c ON c.sink = %s "
                          "AND c.bucket = e.bucket WHERE NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, "
                          "c.after_xid, c.after_seq)", [self.name()])
        known = self._rows("SELECT count(*) FROM outbox.cursors WHERE sink = %s", [self.name()])
        return int(rows[0][0]) if known[0][0] else -1  # -1: no cursors yet

    def parked(self) -> dict[uuid.UUID, tuple[int, str | None]]:
        rows = self._rows("SELECT event_id, attempts, last_error FROM outbox.parked WHERE sink = %s", [self.name()])
        return {r[0]: (r[1], r[2]) for r in rows}

    def parked_for(self, event_id: uuid.UUID) -> float:
        """Seconds until the parked event is due (as the database sees it)."""
        rows = self._rows("SELECT extract(epoch FROM available_at - clock_timestamp()) FROM outbox.parked "
                          "WHERE sink = %s AND event_id = %s", [self.name(), event_id])
        return float(rows[0][0]) if rows else 0.0

    def park_seconds(self, event_id: uuid.UUID) -> float:
        """How long the event's park is, as stored: from when it was first parked to when it is next due (the
        seconds left, ``parked_for``, shrink with every moment a slow test takes); 0.0 when it is not parked."""
        rows = self._rows("SELECT extract(epoch FROM available_at - parked_at) FROM outbox.parked "
                          "WHERE sink = %s AND event_id = %s", [self.name(), event_id])
        return float(rows[0][0]) if rows else 0.0

    def dead_letters(self) -> dict[uuid.UUID, tuple[int, str]]:
        rows = self._rows("SELECT event_id, attempts, last_error FROM outbox.dead_letters WHERE sink = %s",
                          [self.name()])
        return {r[0]: (r[1], r[2]) for r in rows}

    def delivered_ids(self) -> list[uuid.UUID]:
        return self.recorder.snapshot()

    def received_ids(self) -> list[uuid.UUID]:
        got = self.suite.received(self.sink)
        if got is None:
            return self.delivered_ids()
        self.custom_received = True
        return [i if isinstance(i, uuid.UUID) else uuid.UUID(str(i)) for i in got]

    def assert_in_order(self, published: dict[str, list[uuid.UUID]], without: Collection[uuid.UUID] = ()) -> None:
        """Per key, the received ids with repeats removed equal the published ones (minus ``without``)."""
        key_of = {i: key for key, ids in published.items() for i in ids}
        seen: set[uuid.UUID] = set()
        got: dict[str, list[uuid.UUID]] = defaultdict(list)
        for i in self.received_ids():
            if i in key_of and i not in seen:
                seen.add(i)
                got[key_of[i]].append(i)
        want = {key: [i for i in ids if i not in without] for key, ids in published.items()}
        want = {key: ids for key, ids in want.items() if ids}
        assert dict(got) == want, f"sink {self.name()}: per key, received (first time each) != published"
