"""The buckets a runner holds, and the losses it has still to explain."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from .. import store
from ..store import Conn
from .hooks import Hooks

log = logging.getLogger("outbox_relay.relay")  # every part of the runner logs as the relay


class Leases:
    """The buckets a runner holds, bucket -> fence. The runner acquires and releases; the
    membership thread renews and may drop lost buckets. Guarded by one lock because both
    threads touch it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fences: dict[int, int] = {}

    def snapshot(self) -> dict[int, int]:
        with self._lock:
            return dict(self._fences)

    def add(self, fences: dict[int, int]) -> None:
        with self._lock:
            self._fences.update(fences)

    def holds_any(self, buckets: Iterable[int]) -> bool:
        with self._lock:
            return any(b in self._fences for b in buckets)

    def drop(self, buckets: Iterable[int], fences: dict[int, int] | None = None) -> None:
        """Forget buckets (only if still under the given fences, when given)."""
        with self._lock:
            for b in buckets:
                if fences is None or self._fences.get(b) == fences.get(b):
                    self._fences.pop(b, None)

    def still_held(self, held: dict[int, int]) -> dict[int, int]:
        """``held`` without what a check since found lost (it is told once, not by every write after it)."""
        now = self.snapshot()
        return {b: f for b, f in held.items() if now.get(b) == f}


class Losses:
    """Buckets found lost by a read or a checkpoint (runner thread): dropped at once, told why by the next
    cycle, before it takes any of them up again; and the telling of why buckets were lost."""

    def __init__(self, sink_name: str, worker: str, pool: ConnectionPool[Conn], leases: Leases, hooks: Hooks) -> None:
        self.sink_name = sink_name
        self.worker = worker
        self.pool = pool
        self.leases = leases
        self.hooks = hooks
        self._unexplained: set[int] = set()

    def lose(self, lost: set[int], fences: dict[int, int]) -> None:
        self.hooks.observer.leases(self.sink_name, lost=len(lost))
        self._unexplained |= lost
        self.leases.drop(lost, fences)

    def explain(self) -> None:
        lost, self._unexplained = self._unexplained, set()
        if lost:
            self.tell(lost, "fenced out of %d buckets; their batch is discarded and will be redelivered by the "
                            "new owner")

    def tell(self, lost: set[int], takeover: str) -> None:
        """Say why buckets were lost: an operator's re-fence (the lease stays here, ``fenced_by`` names the
        action) at INFO, a takeover or a lease that ran out as the WARNING ``takeover`` (a %d for the count)."""
        try:
            with self.pool.connection() as conn:
                why = store.why_fenced(conn, self.sink_name, self.worker, lost)
        except (psycopg.Error, PoolTimeout) as exc:
            log.debug("sink %s: could not read why buckets were lost: %s", self.sink_name, exc)
            why = {}
        by_action: dict[str, int] = {}
        for action in why.values():
            by_action[action] = by_action.get(action, 0) + 1
        for action, n in sorted(by_action.items()):
            log.info("sink %s: %s (an operator's action) re-fenced %d buckets this relay holds: what it had in "
                     "flight there is discarded, and it takes them up again under the new fence",
                     self.sink_name, action, n)
        if len(lost) > len(why):
            log.warning("sink %s: " + takeover, self.sink_name, len(lost) - len(why))
