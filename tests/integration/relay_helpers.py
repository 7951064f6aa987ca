"""Shared pieces of the relay integration tests: a recording test sink, settings, a pool, SQL probes.

The database and the broker are always real (fixtures ``dsn`` / ``kafka_bootstrap`` from
tests/conftest.py). Only the *sink* is replaced by ``RecordingSink`` where a test is about claim,
order or retry logic: it records every attempt (worker, bucket, fence, time window) and fails the
events it is told to fail.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from outbox_relay import history, store, testing
from outbox_relay.positions import Cursor
from outbox_relay.publish import Outbox
from outbox_relay.relay import SinkRunner
from outbox_relay.settings import RelaySettings
from outbox_relay.sinks.adapter import EventSinkAdapter
from outbox_relay.sinks.engine import Aborted, Commit, Failure, Outcomes
from outbox_relay.store import StoredEvent
from outbox_relay.worker import Worker

SINK = "recorder"
TOPIC = "relay-test"
ALL_BUCKETS = frozenset(range(256))

FailFn = Callable[[StoredEvent, int], Failure | None]  # (event, attempts seen so far) -> outcome


def make_settings(dsn: str, worker_id: str, **overrides: Any) -> RelaySettings:
    """Settings for in-process relays: fast knobs, no Kafka (the test passes its own sinks)."""
    values: dict[str, Any] = {
        "kafka": False,
        "lease_seconds": 30.0,
        "heartbeat_seconds": 0.2,
        "worker_ttl_seconds": 1.0,
        "housekeeping_seconds": 0.5,
        "poll_seconds": 0.05,
        "backoff_base_seconds": 0.01,
        "backoff_max_seconds": 0.05,
        "listen": False,
        "drain_seconds": 20.0,
        # Every batch writes its cursor row, so that a test can read the stored cursor right after a batch.
        # test_cursor_writes.py tests deferred writes; OUTBOX_TEST_CURSOR_FLUSH_SECONDS runs any test with them.
        "cursor_flush_seconds": float(os.environ.get("OUTBOX_TEST_CURSOR_FLUSH_SECONDS", "0")),
    }
    values.update(overrides)
    return RelaySettings(dsn=dsn, worker_id=worker_id, **values)


def _configure(conn: psycopg.Connection[Any]) -> None:
    conn.execute("SET plan_cache_mode = auto")  # as the relay's own pool does


@pytest.fixture(name="pool")
def pool_fixture(dsn: str) -> Iterator[ConnectionPool[Any]]:
    p: ConnectionPool[Any] = ConnectionPool(dsn, min_size=1, max_size=12, open=True, configure=_configure,
                                            kwargs={"autocommit": True})
    try:
        yield p
    finally:
        p.close()


# -- the test sink ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    worker: str
    event_id: uuid.UUID
    key: str
    bucket: int
    fence: int
    position: tuple[int, int]
    error: str | None  # None: delivered

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Batch:
    worker: str
    buckets: frozenset[int]  # every bucket the batch touched (its fences)
    start: float
    end: float = 0.0
    committed: frozenset[int] = frozenset()  # buckets whose fence held at commit
    events: tuple[uuid.UUID, ...] = ()


class RecordingSink(testing.RecordingSink):
    """The testing kit's sink with the bookkeeping these tests read: every attempt as it is made
    (landed or not) with its worker, bucket and fence, and each batch with its timing.

    ``fail(e, n)``: the outcome of an attempt, given the stored event and how many attempts this
    sink saw of it before (0 on the first). Like a correct sink it stops a key at its first
    failure within a batch (the kit's deliver does).
    """

    def __init__(self, worker: str = "w", fail: FailFn | None = None, name: str = SINK, kind: str = "projection",
                 event_filter: store.EventFilter | None = None, hold: float = 0.0,
                 gate: threading.Event | None = None) -> None:
        super().__init__(name, kind="projection")
        self.kind = kind  # any kind, also one the database refuses (tests of that)
        self.worker = worker
        self.fail_with = fail
        self.event_filter = event_filter
        self.hold = hold  # seconds to spend "delivering" each batch (widens the windows G8 checks)
        self.gate = gate  # when given, deliver waits for it (in-flight batch)
        self.entered = threading.Event()
        self.attempts: list[Attempt] = []
        self.batches: list[Batch] = []
        self.lock = threading.Lock()
        self._seen: dict[uuid.UUID, int] = defaultdict(int)
        self._batch: Batch | None = None  # the batch in flight (runner thread)

    def begin(self, events: Sequence[StoredEvent], fences: dict[int, int], abort: threading.Event) -> None:
        batch = self._batch = Batch(self.worker, frozenset(fences), time.monotonic(),
                                    events=tuple(e.id for e in events))
        with self.lock:
            self.batches.append(batch)
        self.entered.set()
        if self.gate is not None:
            while not self.gate.wait(0.05):
                if abort.is_set():
                    raise Aborted()

    def attempt(self, e: StoredEvent, fence: int) -> Failure | None:
        with self.lock:
            n = self._seen[e.id]
            self._seen[e.id] = n + 1
        outcome = self.fail_with(e, n) if self.fail_with is not None else None
        with self.lock:
            self.attempts.append(Attempt(self.worker, e.id, e.key, e.bucket, fence, e.position,
                                         outcome.error if outcome else None))
        return outcome

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        if not self.hold:
            return super().deliver(events, fences, commit, abort)

        def slow(outcomes: Outcomes, tx: Any) -> set[int]:  # the batch stays in flight a while
            time.sleep(self.hold)
            return commit(outcomes, tx)

        return super().deliver(events, fences, slow, abort)  # type: ignore[arg-type]

    def end(self, events: Sequence[StoredEvent], landed: set[int]) -> None:
        assert self._batch is not None
        self._batch.end = time.monotonic()
        self._batch.committed = frozenset(landed)

    # views

    def delivered(self) -> list[Attempt]:  # type: ignore[override]
        with self.lock:
            return [a for a in self.attempts if a.ok]

    def delivered_ids(self) -> set[uuid.UUID]:
        return {a.event_id for a in self.delivered()}

    def attempts_of(self, event_id: uuid.UUID) -> list[Attempt]:
        with self.lock:
            return [a for a in self.attempts if a.event_id == event_id]


def merged_attempts(sinks: Iterable[RecordingSink]) -> list[Attempt]:
    """Attempts of several workers' sinks in one list (each sink's own order is kept)."""
    out: list[Attempt] = []
    for s in sinks:
        with s.lock:
            out.extend(s.attempts)
    return out


def dedup_per_key(attempts: Iterable[Attempt]) -> dict[str, list[uuid.UUID]]:
    """Per key, the delivered event ids with redeliveries removed (first occurrence kept)."""
    seen: set[uuid.UUID] = set()
    out: dict[str, list[uuid.UUID]] = defaultdict(list)
    for a in attempts:
        if a.ok and a.event_id not in seen:
            seen.add(a.event_id)
            out[a.key].append(a.event_id)
    return dict(out)


# -- publishing and probes --------------------------------------------------------------------


def publish(dsn: str, events: Sequence[tuple[str, str, Any]], *, topic: str | None = TOPIC) -> list[uuid.UUID]:
    """Publish (key, type, payload) events in one committed transaction; returns their ids in order."""
    outbox = Outbox(default_topic=topic)
    with psycopg.connect(dsn) as conn:
        published = outbox.publish_many(conn, [{"key": k, "type": t, "payload": p} for k, t, p in events])
    return [p.id for p in published]


def keys_in_bucket(dsn: str, bucket: int, n: int, prefix: str = "key") -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT k FROM (SELECT %s || i AS k FROM generate_series(1, 200000) AS i) s "
            "WHERE outbox.bucket_v1(k) = %s LIMIT %s", (prefix, bucket, n)).fetchall()
    assert len(rows) == n
    return [r[0] for r in rows]


def bucket_of(dsn: str, key: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT outbox.bucket_v1(%s)", (key,)).fetchone()
    assert row is not None
    return int(row[0])


def fetch_all(dsn: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def cursor_row(dsn: str, bucket: int, sink: str = SINK) -> dict[str, Any]:
    """A cursor row; ``cursor`` is it as a positions.Cursor (``.delivered(xid, seq)``)."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            "SELECT snapshot::text, target::text, after_xid::text, after_seq, owner, fence, lease_expires_at, lapses "
            "FROM outbox.cursors WHERE sink = %s AND bucket = %s", (sink, bucket)).fetchone()
    assert row is not None
    row["cursor"] = Cursor.from_row(row["snapshot"], row["target"], row["after_xid"], row["after_seq"])
    return row


def fetch(conn: psycopg.Connection[Any], sink: str, worker: str, limits: dict[int, int],
          wanted: store.EventFilter | None = None) -> store.Read:
    """``store.fetch_events`` from the stored cursors (what a runner that just acquired the buckets reads)."""
    rows = conn.execute("SELECT bucket, snapshot::text, target::text, after_xid::text, after_seq FROM outbox.cursors "
                        "WHERE sink = %s AND bucket = ANY(%s)", (sink, list(limits))).fetchall()
    cursors = {r[0]: Cursor.from_row(r[1], r[2], r[3], r[4]) for r in rows}
    return store.fetch_events(conn, sink, worker, {b: (n, cursors[b]) for b, n in limits.items()}, wanted)


def through(e: StoredEvent) -> Cursor:
    """A cursor that delivered everything up to and including ``e`` (in (xid, seq) order)."""
    return Cursor.at((e.xid, e.seq + 1))


def leased(acquired: dict[int, store.Acquired]) -> dict[int, tuple[int, int]]:
    """bucket -> (fence, lapses) of what ``store.acquire_leases`` returned."""
    return {b: (a.fence, a.lapses) for b, a in acquired.items()}


# Committed events a sink's cursors have not delivered (the relay's own definition, in SQL).
UNDELIVERED_SQL = ("SELECT count(*) FROM outbox.events e JOIN outbox.cursors c ON c.sink = %s AND c.bucket = e.bucket "
                   "WHERE NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq)")


def undelivered(dsn: str, sink: str = SINK) -> int:
    return int(fetch_all(dsn, UNDELIVERED_SQL, (sink,))[0][0])


# Every sink's cursors (or one's, with a %s parameter) past everything committed so far.
DELIVER_ALL_SQL = ("UPDATE outbox.cursors SET snapshot = pg_current_snapshot(), target = NULL, after_xid = NULL, "
                   "after_seq = NULL")


def assigned(dsn: str, sink: str = SINK) -> tuple[list[str], dict[int, str | None]]:
    """The stored assignment of a sink: its members and bucket -> owner (empty before the first relay)."""
    rows = fetch_all(dsn, "SELECT members, owners FROM outbox.assignments WHERE sink = %s", (sink,))
    if not rows:
        return [], {}
    members, owner_list = rows[0]
    return list(members), dict(enumerate(owner_list))


def settled(dsn: str, members: Iterable[str], sink: str = SINK) -> bool:
    """Whether the sink's assignment is made for exactly ``members`` and every bucket is held by its owner."""
    stored, want = assigned(dsn, sink)
    return stored == sorted(members) and owners(dsn, sink) == want


def owners(dsn: str, sink: str = SINK) -> dict[int, str | None]:
    return {b: o for b, o in fetch_all(dsn, "SELECT bucket, owner FROM outbox.cursors WHERE sink = %s", (sink,))}


def dead_letters(dsn: str, sink: str = SINK) -> dict[uuid.UUID, tuple[int, str]]:
    rows = fetch_all(dsn, "SELECT event_id, attempts, last_error FROM outbox.dead_letters WHERE sink = %s", (sink,))
    return {r[0]: (r[1], r[2]) for r in rows}


def parked_ids(dsn: str, sink: str = SINK) -> set[uuid.UUID]:
    return {r[0] for r in fetch_all(dsn, "SELECT event_id FROM outbox.parked WHERE sink = %s", (sink,))}


def close_history(dsn: str) -> None:
    """End the history partition being written (0014): retention removes closed partitions only, and a
    test's events all sit in the one the migration made."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        history.roll(conn, 86400.0, min_width=1000)


def register(dsn: str, sink: str = SINK, kind: str = "projection") -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.register_sink(conn, sink, kind)


def runner_for(sink: Any, pool: ConnectionPool[Any], settings: RelaySettings,
               buckets: Iterable[int] = ALL_BUCKETS) -> SinkRunner:
    """A SinkRunner that wants ``buckets`` (what the membership thread would take from the assignment)."""
    with pool.connection() as conn:
        store.register_sink(conn, sink.name, sink.kind)
    runner = SinkRunner(sink, pool, settings)
    runner.desired = set(buckets)
    return runner


def user_sink_runner(sink: Any, pool: ConnectionPool[Any], dsn: str,
                     **settings: Any) -> tuple[SinkRunner, EventSinkAdapter]:
    """A runner over a user sink (or an adapter made already) and its adapter; ``handler_timeout_seconds``
    goes to the adapter, the rest to the settings."""
    adapter = sink if isinstance(sink, EventSinkAdapter) else EventSinkAdapter(
        sink, handler_timeout_seconds=settings.pop("handler_timeout_seconds", 30.0))
    return runner_for(adapter, pool, make_settings(dsn, "w", **settings)), adapter


@pytest.fixture(name="release")
def release_fixture() -> Iterator[threading.Event]:
    """Set at teardown: lets calls a test abandoned return (their answers, their work, must land nowhere)."""
    released = threading.Event()
    yield released
    released.set()


def run_until(runner: SinkRunner, predicate: Callable[[], Any], timeout: float = 15.0,
              interval: float = 0.01) -> int:
    """Call ``runner.run_once()`` until ``predicate()`` holds; returns how many cycles it took."""
    deadline = time.monotonic() + timeout
    cycles = 0
    while True:
        runner.run_once()
        cycles += 1
        if predicate():
            return cycles
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s ({cycles} cycles) waiting for "
                                 f"{getattr(predicate, '__name__', predicate)!r}")
        time.sleep(interval)


@contextlib.contextmanager
def running(worker: Worker) -> Iterator[Worker]:
    """``worker.run()`` on a thread for the block (as `outbox-relay run`, without signal handlers);
    drained and joined afterwards."""
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    thread.start()
    try:
        yield worker
    finally:
        worker.drain()
        thread.join(30)


def fail_ids(ids: set[uuid.UUID], error: str = "broker said no") -> Any:
    """A RecordingSink ``fail``: these events fail every time they are attempted."""
    def fail(e: StoredEvent, _n: int) -> Failure | None:
        return Failure(error) if e.id in ids else None
    return fail


def attempts_of(sink: RecordingSink, key: str) -> list[uuid.UUID]:
    with sink.lock:
        return [a.event_id for a in sink.attempts if a.key == key]


def parked_rows(dsn: str, key: str, sink: str = SINK) -> list[tuple[uuid.UUID, int, str | None]]:
    return [(r[0], r[1], r[2]) for r in fetch_all(
        dsn, "SELECT event_id, attempts, last_error FROM outbox.parked WHERE sink = %s AND partition_key = %s "
             "ORDER BY xid, seq", (sink, key))]
