"""The housekeeping service: claims a housekeeping pass (housekeeping.py) every interval."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from psycopg_pool import ConnectionPool

from ..dsn import redact
from ..housekeeping import Housekeeping
from ..observer import Observer
from ..settings import RelaySettings
from ..store import Conn
from .thread import ServiceThread

log = logging.getLogger("outbox_relay.worker")

HOUSEKEEPING_STANDBY = 6  # intervals between claim attempts of a relay that is no sink's first live member


class Housekeeper(ServiceThread):
    """Claim a housekeeping pass every interval if this relay is a sink's first live member. The others
    are standbys: every HOUSEKEEPING_STANDBY intervals they claim a pass if none finished for
    HOUSEKEEPING_STANDBY - 1 intervals (the first member's role may not claim, or it hangs). So one
    claim attempt per interval across the cluster, not one per relay. When the first member dies, the
    next one is first from the heartbeat that no longer counts it live (the same TTL after which a
    pass declares it dead), and claims at once. ``run_now`` (a heartbeat stored an assignment without a
    silent relay) has this relay claim a pass at once: a killed relay's buckets move about
    --worker-ttl-seconds after its last heartbeat, not up to one more housekeeping interval later.

    The worker stops it when it starts draining."""

    name = "housekeeping"

    def __init__(self, pool: ConnectionPool[Conn], settings: RelaySettings, observer: Observer, *,
                 first_member: Callable[[], bool], recovered: Callable[[], None]) -> None:
        super().__init__()
        self.housekeeping = Housekeeping(pool, settings)
        self.interval = settings.housekeeping_seconds
        self.observer = observer
        self._first_member = first_member
        self._recovered = recovered  # called after a pass freed leases or declared relays dead
        self._now = threading.Event()  # set by run_now and stop

    def run_now(self) -> None:
        self._now.set()

    def stop(self) -> None:
        super().stop()
        self._now.set()

    def run(self) -> None:
        interval = self.interval
        last_try = time.monotonic()
        while not self.stopped.is_set():
            lost = self._now.wait(interval * (0.75 + 0.5 * (time.monotonic() % 1)))
            if self.stopped.is_set():
                break
            self._now.clear()
            first = self._first_member() or lost
            if not first and time.monotonic() - last_try < HOUSEKEEPING_STANDBY * interval:
                continue
            last_try = time.monotonic()
            try:
                # The first member's own timer paces its passes (an interval, jittered); the gap only keeps
                # two relays that both think they are first (a moment of changing members) from doubling up.
                gap = 0.0 if lost else interval / 2 if first else (HOUSEKEEPING_STANDBY - 1) * interval
                result = self.housekeeping.run_once(min_gap_seconds=gap)
                if result.ran:
                    self.observer.housekeeping(seconds=result.seconds, dead_workers=result.dead_workers,
                                               expired_leases=result.expired_leases,
                                               deleted_events=result.deleted_events)
                if result.expired_leases or result.dead_workers:
                    self._recovered()
            except Exception as exc:
                log.warning("housekeeping: %s: %s", type(exc).__name__, redact(str(exc)))
