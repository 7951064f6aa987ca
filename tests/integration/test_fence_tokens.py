"""Projection fence tokens follow delivery order per key, against a real PostgreSQL.

The relay loop is the real SinkRunner, the sink the real ProjectionSink, rebuilds the real
``Rebuild`` and ``rebuild_key``. The handler writes "another store" (a table written through a
connection of its own, outside the relay's transaction) with ``fenced_upsert`` and logs each token
it was given in its own table (inside the relay's transaction, so only deliveries that landed stay).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import store
from outbox_relay.publish import Outbox
from outbox_relay.relay import SinkRunner
from projections import FenceToken, Projection, ProjectionEvent, fenced_upsert, projection
from projections.rebuild import Rebuild, rebuild_key
from projections.sink import ProjectionSink
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    TOPIC,
    fetch_all,
    keys_in_bucket,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    run_until,
)

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

TABLES = """
CREATE TABLE remote_state (key text PRIMARY KEY, n text NOT NULL, fence_token text NOT NULL);
CREATE TABLE token_log (i bigserial PRIMARY KEY, key text NOT NULL, n text NOT NULL, token text NOT NULL,
                        replay boolean NOT NULL);
"""

Hook = Callable[[ProjectionEvent[Any], Any], None]
Call = tuple[str, FenceToken]  # (the event's "n", the token its handler call got)


@pytest.fixture(name="other")
def other_fixture(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """The other store's connection (autocommit: its writes land whatever the relay's transaction does)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLES)
        yield conn


_open_sinks: list[ProjectionSink] = []


@pytest.fixture(autouse=True)
def _close_sinks() -> Iterator[None]:
    yield
    while _open_sinks:
        _open_sinks.pop().close()


def remote_projection(other: psycopg.Connection[Any], calls: list[Call] | None = None, before: Hook | None = None,
                      after: Hook | None = None) -> Projection:
    @projection("remote", events=["t"], tables=["token_log"])
    def apply(event: ProjectionEvent[Any], tx: Any) -> None:
        n = event.payload["n"]
        if calls is not None:
            calls.append((n, event.token))
        if before is not None:
            before(event, tx)
        fenced_upsert(other, "remote_state", {"key": event.key}, {"n": n}, event.token)
        if after is not None:
            after(event, tx)
        tx.execute("INSERT INTO token_log (key, n, token, replay) VALUES (%s, %s, %s, %s)",
                   (event.key, n, str(event.token), event.replay))

    @apply.key_reset
    def reset(key: str, tx: Any) -> None:
        tx.execute("DELETE FROM token_log WHERE key = %s", (key,))

    return apply


def runner(p: Projection, dsn: str, pool: ConnectionPool[Any], worker: str, buckets: set[int]) -> SinkRunner:
    sink = ProjectionSink(p, dsn)
    _open_sinks.append(sink)
    with pool.connection() as conn:
        store.register_sink(conn, sink.name, sink.kind)
    r = SinkRunner(sink, pool, make_settings(dsn, worker))
    r.desired = set(buckets)
    return r


def landed(dsn: str, key: str) -> list[tuple[str, FenceToken, bool]]:
    """(n, token, replay) of the key's deliveries that landed, in the order they landed."""
    rows = fetch_all(dsn, "SELECT n, token, replay FROM token_log WHERE key = %s ORDER BY i", (key,))
    return [(n, FenceToken.parse(t), replay) for n, t, replay in rows]


def remote(dsn: str) -> dict[str, tuple[str, FenceToken]]:
    return {k: (n, FenceToken.parse(t)) for k, n, t in fetch_all(dsn, "SELECT key, n, fence_token FROM remote_state")}


def increasing(tokens: list[FenceToken]) -> bool:
    return all(a < b for a, b in itertools.pairwise(tokens))


def publish_overlapping(dsn: str, key: str, first: str, second: str, deliver: Callable[[], None]) -> None:
    """Two transactions on ``key``: the one publishing ``second`` takes its id first and commits last, so
    ``first`` (the larger id) becomes visible first; ``deliver()`` runs while ``second`` is still open."""
    with psycopg.connect(dsn) as t1:
        Outbox(default_topic=TOPIC).publish(t1, type="t", key=key, payload={"n": second})
        publish(dsn, [(key, "t", {"n": first})])
        deliver()


def test_the_later_delivered_of_two_overlapping_transactions_lands_in_another_store(
        dsn: str, pool: ConnectionPool[Any], other: psycopg.Connection[Any]) -> None:
    """The pinned overlapping case (test_delivery.py): b is delivered before a, although a has the
    smaller id. The other store must end with a, the last event delivered."""
    bucket = 40
    (k,) = keys_in_bucket(dsn, bucket, 1)
    r = runner(remote_projection(other), dsn, pool, "w", {bucket})

    def deliver_b() -> None:
        run_until(r, lambda: [n for n, _, _ in landed(dsn, k)] == ["b"])
        assert remote(dsn)[k][0] == "b"

    publish_overlapping(dsn, k, "b", "a", deliver_b)
    run_until(r, lambda: len(landed(dsn, k)) == 2)
    got = landed(dsn, k)
    assert [n for n, _, _ in got] == ["b", "a"], "delivered in the order the transactions became visible"
    xid = dict(fetch_all(dsn, "SELECT payload->>'n', xid::text::bigint FROM outbox.events"))
    assert xid["a"] < xid["b"], "the case where delivery order is not (xid, seq) order"
    assert remote(dsn)[k][0] == "a", "the other store refused the later-delivered event's write"
    assert increasing([t for _, t, _ in got]), got
    assert remote(dsn)[k][1] == got[-1][1]


def test_tokens_grow_per_key_through_overlap_retry_failed_batch_and_owner_change(
        dsn: str, pool: ConnectionPool[Any], other: psycopg.Connection[Any]) -> None:
    bucket = 41
    k, j = keys_in_bucket(dsn, bucket, 2)  # two keys, one bucket
    calls: list[Call] = []
    killed: list[int] = []

    def fail_5(event: ProjectionEvent[Any], tx: Any) -> None:
        if event.payload["n"] == "5" and event.attempt == 1:
            raise RuntimeError("the first attempt of 5 fails")

    def kill_at_7(event: ProjectionEvent[Any], tx: Any) -> None:
        """After 7's write to the other store, the database drops the relay's session: the batch fails."""
        if event.payload["n"] == "7" and not killed:
            killed.append(tx.info.backend_pid)
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (tx.info.backend_pid,))

    p = remote_projection(other, calls, before=fail_5, after=kill_at_7)
    w1 = runner(p, dsn, pool, "w1", {bucket})

    def done(*ns: str) -> Callable[[], bool]:
        return lambda: [n for n, _, _ in landed(dsn, k)][-len(ns):] == list(ns)

    publish(dsn, [(k, "t", {"n": "1"}), (k, "t", {"n": "2"}), (j, "t", {"n": "x1"})])
    run_until(w1, done("1", "2"))
    # Overlapping transactions: 3 becomes visible first, 4 has the smaller id.
    publish_overlapping(dsn, k, "3", "4", lambda: run_until(w1, done("3")))
    run_until(w1, done("4"))
    assert remote(dsn)[k][0] == "4"
    # A retry: 5 fails once and is parked, 6 waits behind it; both come back from the park.
    for n, key in (("5", k), ("6", k), ("x2", j)):
        publish(dsn, [(key, "t", {"n": n})])
    run_until(w1, lambda: parked_ids(dsn, "remote"))
    run_until(w1, done("5", "6"))
    assert not parked_ids(dsn, "remote")
    # A batch that fails after 7 reached the other store is read and delivered again.
    publish(dsn, [(k, "t", {"n": "7"}), (k, "t", {"n": "8"})])
    with pytest.raises(psycopg.OperationalError):
        w1.run_once()
    failed = remote(dsn)[k]  # 7's write, and 8's (pipelined, the batch learns of the loss at its end)
    assert failed[0] in ("7", "8") and failed[1] == calls[-1][1], "the failed batch's writes reached the other store"
    run_until(w1, done("7", "8"))
    assert remote(dsn)[k][0] == "8" and remote(dsn)[k][1] > failed[1], "the redelivery was written again"
    # The owner changes.
    w1.desired = set()
    w1.run_once()
    w2 = runner(p, dsn, pool, "w2", {bucket})
    publish(dsn, [(k, "t", {"n": "9"}), (j, "t", {"n": "x3"})])
    run_until(w2, done("9"))

    got = landed(dsn, k)
    assert [n for n, _, _ in got] == [str(i) for i in range(1, 10)], "each event landed once, in delivery order"
    tokens = [t for _, t, _ in got]
    assert increasing(tokens), got
    assert increasing([t for _, t, _ in landed(dsn, j)]), landed(dsn, j)
    assert remote(dsn)[k] == ("9", tokens[-1]) and remote(dsn)[j][0] == "x3"
    # Every handler call of 7 got a larger token than the one before it (the redelivery outranks the
    # failed batch's write); reads are numbered again from 1 under the new owner's fence.
    sevens = [t for n, t in calls if n == "7"]
    assert len(sevens) == 2 and sevens[0] < sevens[1], sevens
    f1, f2 = tokens[0].fence, tokens[-1].fence
    assert {t.fence for t in tokens[:-1]} == {f1} and f2 > f1 and tokens[-1].read == 1


def test_rebuild_and_key_rebuild_tokens_grow_in_the_order_they_apply_and_live_outranks_them_after(
        dsn: str, pool: ConnectionPool[Any], other: psycopg.Connection[Any]) -> None:
    """A rebuild replays history in (xid, seq) order; its tokens grow in that order, and after the
    switch the live projection's tokens are above every token of the rebuild, however often the
    rebuild's buckets changed hands (a resumed rebuild, several rebuild processes)."""
    bucket = 42
    (k,) = keys_in_bucket(dsn, bucket, 1)
    live = runner(remote_projection(other), dsn, pool, "live", {bucket})
    publish(dsn, [(k, "t", {"n": "1"})])
    publish_overlapping(dsn, k, "2", "3", lambda: run_until(live, lambda: len(landed(dsn, k)) == 2))
    publish(dsn, [(k, "t", {"n": "4"})])
    run_until(live, lambda: len(landed(dsn, k)) == 4)
    live_tokens = [t for _, t, _ in landed(dsn, k)]
    assert [n for n, _, _ in landed(dsn, k)] == ["1", "2", "3", "4"] and increasing(live_tokens)

    # A key rebuild replays under the live fence with read 0: in (xid, seq) order, increasing, and
    # below what live processing wrote to the other store (which keeps it).
    assert rebuild_key(remote_projection(other), dsn, k) == 4
    replayed = landed(dsn, k)
    assert [n for n, _, _ in replayed] == ["1", "3", "2", "4"] and all(r for _, _, r in replayed)
    assert increasing([t for _, t, _ in replayed]) and {(t.fence, t.read) for _, t, _ in replayed} == {
        (live_tokens[-1].fence, 0)}
    assert max(t for _, t, _ in replayed) < live_tokens[0]
    assert remote(dsn)[k] == ("4", live_tokens[-1])

    stolen: list[int] = []

    def steal(event: ProjectionEvent[Any], tx: Any) -> None:
        """The rebuild's bucket changes hands under it (as when a rebuild is resumed, or rebuild
        processes share the work): its batch is fenced out, and it takes the bucket up again."""
        if len(stolen) < 3:
            stolen.append(event.token.fence)
            with psycopg.connect(dsn, autocommit=True) as thief:
                thief.execute("UPDATE outbox.cursors SET fence = fence + 1 WHERE sink = 'remote.rebuild' "
                              "AND bucket = %s", (bucket,))

    settings = make_settings(dsn, "rebuilder", batch_size=200)
    result = Rebuild(remote_projection(other, before=steal), settings, progress=None).run()
    assert result is not None and result.events == 4 and len(stolen) == 3
    rebuilt = landed(dsn, k)
    assert [n for n, _, _ in rebuilt] == ["1", "3", "2", "4"] and all(r for _, _, r in rebuilt)
    assert increasing([t for _, t, _ in rebuilt]), rebuilt
    assert rebuilt[0][1].fence > live_tokens[-1].fence + 2, "the case to check: the rebuild's fences went past"

    publish(dsn, [(k, "t", {"n": "5"})])
    run_until(live, lambda: len(landed(dsn, k)) == 5)  # fenced out by the switch, it takes the bucket again
    after = landed(dsn, k)
    assert after[-1][0] == "5" and not after[-1][2]
    assert remote(dsn)[k][0] == "5", "the live write after the switch was refused"
    assert increasing([t for _, t, _ in after]), after
