"""A rebuild's switch-over (rebuild.py step 3), in one transaction: lock the live tables and cursors, wait
until the rebuild has applied every event the live projection did, move the live tables out and the copies
in, give the live projection the rebuild's cursors, parked events and dead letters merged with its own
(decisions.py: what live processing decided stays decided, G12), and drop the rebuild's sink."""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
from psycopg import sql

from outbox_relay import store
from outbox_relay.sqlfiles import query
from outbox_relay.worker import Worker

from .decisions import WaitingKey, follow_live, keep_live_decisions, waiting_keys
from .declare import Projection
from .rebuild_error import RebuildError
from .rebuild_running import RunningRebuild
from .rebuild_tables import carry_privileges, template

log = logging.getLogger("outbox_relay.rebuild")

SWITCH_LOCK_TIMEOUT = "5s"
SWITCH_TRIES = 12
# How long the switch-over holds the live tables (writers and readers wait) for the relay phase to apply what
# the live projection applied since the rebuild last caught up, and how often it looks meanwhile.
CATCH_UP_SECONDS = 2.0
CATCH_UP_POLL_SECONDS = 0.02


class SwitchOver:
    """The switch of one running rebuild; after it, ``waiting`` and ``dropped`` say what it found."""

    def __init__(self, projection: Projection, dsn: str, running: RunningRebuild, *, live_sink: str, shadow: str,
                 retired: str, keep_old: bool, event_filter: dict[str, Any]) -> None:
        self.projection = projection
        self.dsn = dsn
        self.running = running
        self.live_sink = live_sink
        self.shadow = shadow
        self.retired = retired
        self.keep_old = keep_old
        self.filter = event_filter
        # What the switch found (set in its transaction).
        self.waiting: list[WaitingKey] = []  # keys whose events wait in the park after it
        self.dropped: list[str] = []  # live decisions the new model could not keep, as sentences

    def switch(self, worker: Worker | None) -> bool:
        """Swap the copies in; False if the rebuild has not applied every event the live projection has
        (``worker``, the relay phase still running, had CATCH_UP_SECONDS to get there under the switch's
        locks; without one, none)."""
        for attempt in range(1, SWITCH_TRIES + 1):
            try:
                with psycopg.connect(self.dsn, autocommit=True) as conn:
                    return self._switch_once(conn, worker)
            except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as exc:
                log.warning("rebuild %s: switch-over attempt %d waited too long for locks (%s); retrying",
                            self.projection.name, attempt, type(exc).__name__)
                time.sleep(min(5.0, 0.2 * attempt))
        raise RebuildError(f"rebuild {self.projection.name!r}: could not lock the live tables to switch over "
                           f"after {SWITCH_TRIES} tries; long transactions on them? Run it again to retry")

    def _switch_once(self, conn: psycopg.Connection[Any], worker: Worker | None) -> bool:
        """The switch-over in one transaction. The live tables are locked first (live batches in flight
        land, later ones and readers wait) and the live cursors with them; then the rebuild must have
        applied every event the live projection did (``behind_live``), or a reader could miss in the new
        model an event it saw in the old one: the running relay phase gets CATCH_UP_SECONDS to get there,
        and its last batch lands. Then the copies and both sinks' cursors are locked, and the tables swap."""
        names = {"live": self.live_sink, "rebuild": self.running.sink}
        tables = self.running.tables
        with conn.transaction():
            conn.execute("SELECT set_config('lock_timeout', %s, true)", (SWITCH_LOCK_TIMEOUT,))
            conn.execute(query("rebuild", "lock_projection"), {"projection": self.projection.name})
            if not self.running.still_running(conn):
                return True
            # ACCESS EXCLUSIVE from the start, not a lock that lets readers on and is raised for the swap: a
            # live batch that read a table and then waited to write it would deadlock with the raise.
            for t in sorted(tables, key=lambda t: t.oid):
                conn.execute(template("lock_table", table=sql.Identifier(t.schema, t.name)))
            store.register_sink(conn, self.live_sink, "projection", self.projection.topics)
            conn.execute(query("rebuild", "lock_live_cursors"), names)
            if not self._caught_up_with_live(conn, worker):
                return False  # rolls back: the live projection goes on
            # The copies too, before the cursors: a peer process's relay batch in flight lands first, and
            # none starts after (one that read a copy, then waited for the cursors, would deadlock).
            for t in sorted(tables, key=lambda t: t.name):
                conn.execute(template("lock_table", table=sql.Identifier(self.shadow, t.name)))
            conn.execute(query("rebuild", "lock_cursors"), names)
            conn.execute(query("rebuild", "adopt_cursors"), names)
            conn.execute(query("rebuild", "adopt_history"), names)
            self.dropped = keep_live_decisions(conn, self.live_sink, self.running.sink)
            for line in self.dropped:  # said before the swap commits
                log.warning("rebuild %s: %s", self.projection.name, line)
            conn.execute(query("rebuild", "adopt_parked"), names)
            conn.execute(query("rebuild", "adopt_dead_letters"), names)
            self.waiting = waiting_keys(conn, self.live_sink)
            retired = sql.Identifier(self.retired)
            conn.execute(template("drop_schema", schema=retired))  # what an earlier --keep-old kept
            conn.execute(template("create_schema", schema=retired))
            for t in tables:
                conn.execute(template("move_table", table=sql.Identifier(t.schema, t.name), schema=retired))
                conn.execute(template("move_table", table=sql.Identifier(self.shadow, t.name),
                                       schema=sql.Identifier(t.schema)))
                carry_privileges(conn, t)
            conn.execute(template("drop_schema", schema=sql.Identifier(self.shadow)))
            if not self.keep_old:
                conn.execute(template("drop_schema", schema=retired))
            conn.execute(query("rebuild", "drop_sink"), {"sink": self.running.sink})
        return True

    def _caught_up_with_live(self, conn: psycopg.Connection[Any], worker: Worker | None) -> bool:
        """Whether the rebuild's cursors pass every event the live projection's do (locked: they stand
        still); with ``worker`` running, waits up to CATCH_UP_SECONDS for them to get there. Each look is a
        statement of its own, so it sees the relay phase's checkpoints as they commit."""
        deadline = time.monotonic() + CATCH_UP_SECONDS
        params = {"live": self.live_sink, "rebuild": self.running.sink, **self.filter}
        while True:
            row = conn.execute(query("rebuild", "behind_live"), params).fetchone()
            behind = int(row[0]) if row else 0
            if worker is not None:
                with psycopg.connect(self.dsn, autocommit=True) as other:  # these rows must stay unlocked here
                    behind += follow_live(other, self.live_sink, self.running.sink)
            if behind == 0:
                if worker is None:
                    return True
                # The relay phase's batch in flight lands in the copies (its writes and cursors are not
                # locked yet); it starts no other. Then nothing writes the copies but this transaction.
                worker.drain()
                if worker.sinks_done(max(0.0, deadline - time.monotonic())):
                    return True
                log.info("rebuild %s: the relay phase's last batch did not land within %gs", self.projection.name,
                         CATCH_UP_SECONDS)
                return False
            if worker is None or worker.stopping.is_set() or time.monotonic() >= deadline:
                log.info("rebuild %s: the live projection applied events the rebuild has not yet, in %d buckets",
                         self.projection.name, behind)
                return False
            time.sleep(CATCH_UP_POLL_SECONDS)
