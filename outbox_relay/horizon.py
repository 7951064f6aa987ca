"""Whether a long transaction holds back vacuum now, which decides whether a Kafka sink's cursor writes
are worth deferring (docs/design-read-path.md, "Checkpoint writes").

Every write of a cursor row leaves a dead row version. While nothing holds the vacuum horizon back,
page pruning removes it at once and a write costs next to nothing; writing the cursor with every batch
then means that a next owner (after a crash, a lease lost to a paused or starved process) resends only
the batch that was in flight. While a transaction stays open somewhere on the server, every write stays
behind until it ends, and writes are worth bounding (``cursor_flush_seconds``) at the price of resending
up to that many seconds of acknowledged events after a crash.

The membership thread asks for the server's oldest held transaction id once per heartbeat
(``vacuum_horizon`` in sql/queries/membership.sql). A horizon whose transaction has been open for
``HELD_AFTER_SECONDS`` (where the relay's role may see when it began), or that is the same id for that
long between heartbeats (where it may not), is held; one that moves (or is none) is not. Runners only
read ``held``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("outbox_relay.horizon")

# How long the oldest transaction id must stay the oldest before the horizon counts as held. Longer than
# any of the relay's or a producer's own statements, short next to what a deferral saves (issue 16: one
# dead row per bucket per batch while a transaction stays open for minutes).
HELD_AFTER_SECONDS = 1.0


class HorizonWatch:
    """The horizon as heartbeats saw it. Written by the membership thread (``observe``); ``held`` is
    read by the runners (a bool, so no lock)."""

    def __init__(self, held_after: float = HELD_AFTER_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.held_after = held_after
        self._clock = clock
        self._oldest: str | None = None
        self._since = 0.0  # when ``_oldest`` was first seen as the oldest
        self._held = False

    def held(self) -> bool:
        return self._held

    def observe(self, oldest: str | None, open_seconds: float | None = None) -> bool:
        """Take one heartbeat's horizon (and how long its transaction has been open, if known); whether
        ``held`` changed."""
        now = self._clock()
        if oldest is None or oldest != self._oldest:
            self._oldest, self._since = oldest, now
        if open_seconds is not None:  # known: no need to wait for the next heartbeat to see it stay
            self._since = min(self._since, now - open_seconds)
        held = oldest is not None and now - self._since >= self.held_after
        if held == self._held:
            return False
        self._held = held
        if held:
            log.info("transaction %s has held back vacuum for %.0fs or more: deferring cursor writes "
                     "(each would leave a dead row version until it ends)", oldest, now - self._since)
        else:
            log.info("vacuum is no longer held back: cursor writes go with every batch again")
        return True
