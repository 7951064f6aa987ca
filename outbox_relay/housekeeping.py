"""Recovery and retention, one pass per interval across all relays.

A pass is claimed with one UPDATE of the single row of ``outbox.housekeeping`` (the last pass
finished an interval ago, or the one in progress went stale or its relay stopped heartbeating),
so one relay per interval does the work however many run, and any relay can see when housekeeping
last ran and warn when it has not for a long time. Only roles allowed to update that row take
part; no other role can stop housekeeping (an advisory lock can be held by any role).

A pass: workers that stopped heartbeating are marked dead (they already left the stored
assignment, which counts only live members); expired leases and the leases of dead workers are
freed, and the transactions their owners still hold are terminated (every one of a dead relay, those
older than the lease of a live one), so that row locks do not outlive the lease; the next partition of
``outbox.events`` is made ahead, and partitions whose events every sink has delivered and whose retention
class has let go of them are dropped whole (history.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import psycopg
from psycopg_pool import ConnectionPool

from . import history, store
from .dsn import describe_error
from .settings import RelaySettings
from .sqlfiles import query
from .store import Conn

log = logging.getLogger("outbox_relay.housekeeping")

FORGET_DEAD_AFTER_SECONDS = 3600.0
RETENTION_SECONDS_PER_PASS = 1.0  # retention's share of one housekeeping pass
OVERDUE_CHECK_SECONDS = 60.0  # how often a relay that did not run a pass checks that someone did


def application_name(worker_id: str) -> str:
    """What every connection of a relay is called in pg_stat_activity (housekeeping finds a stalled
    relay's connections by it)."""
    return f"outbox-relay {worker_id}"[:63]


@dataclass(frozen=True)
class HousekeepingResult:
    ran: bool  # False: another relay has this interval's pass (or this one may not run it)
    dead_workers: int = 0
    expired_leases: int = 0
    deleted_events: int = 0
    terminated_connections: int = 0
    seconds: float = 0.0  # how long the pass took


class Housekeeping:
    def __init__(self, pool: ConnectionPool[Conn], settings: RelaySettings) -> None:
        self.pool = pool
        self.settings = settings
        self.allowed = True  # False once the database said this relay's role may not claim a pass
        self._may_terminate = True
        self._overdue_checked = time.monotonic()

    @property
    def stale_seconds(self) -> float:
        """A pass in progress for this long is taken over (its relay hung or died mid-pass)."""
        return 2 * self.settings.housekeeping_seconds + RETENTION_SECONDS_PER_PASS + 10.0

    @property
    def overdue_seconds(self) -> float:
        """No pass finished for this long: say so (lease expiry and retention are not happening)."""
        return max(60.0, 10 * self.settings.housekeeping_seconds)

    def run_once(self, min_gap_seconds: float = 0.0) -> HousekeepingResult:
        """One pass, unless another relay's is in progress, or (``min_gap_seconds``, the relays' own
        schedule) one finished less than that long ago."""
        s = self.settings
        started = time.monotonic()
        # Each step checks a connection out of the relay's pool and gives it back, so that the runners,
        # which may share that one connection, wait at most one step (a retention slice: milliseconds).
        with self.pool.connection() as conn:
            if not self._claim(conn, min_gap_seconds):
                self._warn_if_overdue(conn)
                return HousekeepingResult(ran=False)
        try:
            with self.pool.connection() as conn, conn.transaction():
                dead = conn.execute(query("housekeeping", "mark_dead_workers"),
                                    {"ttl": s.worker_ttl_seconds, "worker": s.worker_id}).fetchall()
                expired = conn.execute(query("housekeeping", "expire_leases")).fetchall()
                conn.execute(query("housekeeping", "forget_dead_workers"), {"forget_after": FORGET_DEAD_AFTER_SECONDS})
            # Owners whose leases were just taken back, and relays just declared dead (their leases may
            # have expired in an earlier pass, while they still looked alive).
            owners = sorted({r[2] for r in expired})
            stalled = sorted(set(owners) | {r[0] for r in dead})
            with self.pool.connection() as conn:
                if expired:
                    store.announce_buckets(conn, {r[1] for r in expired})
                terminated = self._terminate_stalled(conn, stalled) if stalled else 0
            with self.pool.connection() as conn:
                made = history.make_ahead(conn, s.partition_seconds)
            if made:
                log.info("housekeeping: history partitions %s made ahead", made)
            deleted = self._apply_retention()
        finally:
            with self.pool.connection() as conn:
                conn.execute(query("housekeeping", "finish"), {"worker": s.worker_id})
        if dead:
            log.warning("housekeeping: workers %s stopped heartbeating; marked dead, their leases freed",
                        [r[0] for r in dead])
        if expired:
            log.warning("housekeeping: %d expired leases returned (owners %s)", len(expired), owners)
        if deleted:
            log.info("housekeeping: retention removed %d events", deleted)
        return HousekeepingResult(True, len(dead), len(expired), deleted, terminated, time.monotonic() - started)

    def _claim(self, conn: Conn, min_gap_seconds: float) -> bool:
        if not self.allowed:
            return False
        s = self.settings
        try:
            row = conn.execute(query("housekeeping", "claim"), {
                "worker": s.worker_id, "interval": min_gap_seconds, "stale": self.stale_seconds,
                "ttl": s.worker_ttl_seconds}).fetchone()
        except psycopg.errors.InsufficientPrivilege:
            self.allowed = False
            log.info("housekeeping: this relay's role may not update outbox.housekeeping, so it leaves "
                     "housekeeping to relays that may (docs/roles.md)")
            return False
        return row is not None

    def _terminate_stalled(self, conn: Conn, owners: list[str]) -> int:
        """End the transactions a stalled owner still holds, so that its row locks go with its lease."""
        if not self._may_terminate:
            return 0
        try:
            rows = conn.execute(query("housekeeping", "terminate_stalled"), {
                "owners": owners, "application_names": [application_name(o) for o in owners],
                "lease_seconds": self.settings.lease_seconds}).fetchall()
        except psycopg.errors.InsufficientPrivilege as exc:
            self._may_terminate = False
            log.warning("housekeeping: may not terminate the connections of stalled relays (%s); their row locks "
                        "last until their transactions end. Run all relays as one role, or GRANT pg_signal_backend",
                        describe_error(exc))
            return 0
        done = [r for r in rows if r[2]]
        if done:
            log.warning("housekeeping: terminated %d connections of stalled relays (%s): their transactions "
                        "outlived the leases they lost", len(done), sorted({r[1] for r in done}))
        return len(done)

    def _warn_if_overdue(self, conn: Conn) -> None:
        now = time.monotonic()
        if now - self._overdue_checked < OVERDUE_CHECK_SECONDS:
            return
        self._overdue_checked = now
        row = conn.execute(query("housekeeping", "last_run")).fetchone()
        if row is not None and row[0] is not None and row[0] > self.overdue_seconds:
            since = "never" if row[0] == float("inf") else f"{row[0]:.0f}s ago"
            log.warning("housekeeping last finished %s (%s): leases of dead relays are not freed and retention "
                        "is not running. Is a relay whose role may update outbox.housekeeping running?",
                        since, f"in progress on {row[1]}" if row[2] else f"last run by {row[1] or 'nobody'}")

    def _apply_retention(self) -> int:
        """Drop whole partitions that may go (history.retire), within a time budget; returns the events removed."""
        with self.pool.connection() as conn:
            retired = history.retire(conn, self.settings.retention_seconds, RETENTION_SECONDS_PER_PASS)
        if retired:
            log.info("housekeeping: retention dropped partitions %s", [(r.partition, r.events) for r in retired])
        return sum(r.events for r in retired)
