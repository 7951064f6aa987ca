"""Recovery and retention, run by one worker at a time under a transaction-scoped advisory lock."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from psycopg_pool import ConnectionPool

from .settings import RelaySettings
from .sqlfiles import query
from .store import Conn

log = logging.getLogger("outbox_relay.housekeeping")

HOUSEKEEPING_LOCK = 0x6F7574626F7801  # distinct from the migration lock
FORGET_DEAD_AFTER_SECONDS = 3600.0
RETENTION_SECONDS_PER_PASS = 1.0  # retention's share of one housekeeping pass


@dataclass(frozen=True)
class HousekeepingResult:
    ran: bool  # False: another worker holds the lock
    dead_workers: int = 0
    expired_leases: int = 0
    deleted_events: int = 0


class Housekeeping:
    def __init__(self, pool: ConnectionPool[Conn], settings: RelaySettings) -> None:
        self.pool = pool
        self.settings = settings

    def run_once(self) -> HousekeepingResult:
        s = self.settings
        with self.pool.connection() as conn:
            with conn.transaction():
                if not self._locked(conn):
                    return HousekeepingResult(ran=False)
                dead = conn.execute(query("housekeeping", "mark_dead_workers"),
                                    {"ttl": s.worker_ttl_seconds}).fetchall()
                expired = conn.execute(query("housekeeping", "expire_leases")).fetchall()
                conn.execute(query("housekeeping", "forget_dead_workers"), {"forget_after": FORGET_DEAD_AFTER_SECONDS})
            deleted = self._apply_retention(conn)
        if dead:
            log.warning("housekeeping: workers %s stopped heartbeating; they left the ring", [r[0] for r in dead])
        if expired:
            log.warning("housekeeping: %d expired leases returned (owners %s)", len(expired),
                        sorted({r[2] for r in expired}))
        if deleted:
            log.info("housekeeping: retention deleted %d events", deleted)
        return HousekeepingResult(True, len(dead), len(expired), deleted)

    def _apply_retention(self, conn: Conn) -> int:
        """Delete old delivered events in slices, each its own short transaction.

        A transaction that has written holds back every relay's read horizon until it ends, so
        retention never deletes much at once; it goes on slice by slice, within a time budget."""
        s = self.settings
        deleted = 0
        deadline = time.monotonic() + RETENTION_SECONDS_PER_PASS
        while time.monotonic() < deadline:
            with conn.transaction():
                if not self._locked(conn):
                    break
                n = conn.execute(query("housekeeping", "apply_retention"),
                                 {"retention": s.retention_seconds, "limit": s.retention_batch}).rowcount
            deleted += max(0, n)
            if n < s.retention_batch:
                break
        return deleted

    @staticmethod
    def _locked(conn: Conn) -> bool:
        row = conn.execute(query("housekeeping", "try_lock"), {"lock_key": HOUSEKEEPING_LOCK}).fetchone()
        return bool(row and row[0])
