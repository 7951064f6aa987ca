"""The relay's connection pool: opened once the database answers, every connection set up alike."""

from __future__ import annotations

import itertools
import logging
import threading

from psycopg_pool import ConnectionPool, PoolTimeout

from ..backoff import Backoff
from ..dsn import probe_connection, redact
from ..housekeeping import application_name
from ..store import Conn

log = logging.getLogger("outbox_relay.worker")

RECONNECT = Backoff(1.0, 30.0)  # waiting for the database: to start, and to listen again


def configure_connection(conn: Conn) -> None:
    """Set up each connection of a relay's pool."""
    # Postgres' default, whatever the role or database says: once psycopg prepares a statement (its
    # 5th execution), Postgres may plan it once for all values. Planning was about 1 ms of each 1.5 ms
    # read and a large share of each checkpoint; with cached plans commit -> ack p99 at 1k ev/s went
    # from 16 to 12 ms (1 relay) and 49 to 21 ms (4 relays). A generic plan of a bucket-filtered
    # statement can be the GUIDE's trap (section 4): tests/integration/test_relay_plan.py pins the
    # generic plans of the read and of retention to the same index walks as the custom ones.
    conn.execute("SET plan_cache_mode = auto")
    # Every statement of a relay is an index walk by design (test_relay_plan.py). A generic plan made while a
    # partition was new and analysed empty would be a sequential scan instead, kept until the partition is
    # next analysed: the read then scanned the whole growing partition per bucket (0024 did this for the
    # commit watcher's function). Off, a scan of a table is chosen only where no index can serve.
    conn.execute("SET enable_seqscan = off")
    # Before PostgreSQL 18 a disabled scan adds a huge cost instead of being counted, which pushed a statement
    # that has to scan a small table (the heartbeat's workers) over jit_above_cost: 150 ms of JIT compiling per
    # heartbeat on PostgreSQL 15. A relay's statements are short; JIT never pays for them.
    conn.execute("SET jit = off")


def open_pool(dsn: str, max_size: int, worker_id: str, stopping: threading.Event) -> ConnectionPool[Conn] | None:
    """Wait for the database (a relay started before it is normal in a deploy).

    None if asked to stop first. A pool whose opening timed out is closed by psycopg_pool
    and can not be reopened, so each attempt makes a new one."""
    for attempt in itertools.count(1):
        if stopping.is_set():
            return None
        delay = RECONNECT.delay(attempt)
        pool: ConnectionPool[Conn] = ConnectionPool(
            dsn, min_size=1, max_size=max_size, open=False, configure=configure_connection,
            kwargs={"autocommit": True, "application_name": application_name(worker_id)},
            name="outbox-relay",
        )
        try:
            pool.open(wait=True, timeout=min(10.0, max(delay, 2.0)))
            return pool
        except PoolTimeout:
            pool.close()
        # The pool does not say why (too many connections, a wrong password, a missing database...).
        reason = probe_connection(dsn) or "the connection pool could not open a connection in time"
        log.warning("database %s is unavailable (%s); retrying in %.0fs", redact(dsn), reason, delay)
        stopping.wait(delay)
    raise AssertionError("unreachable")
