"""What the worker tells a runner after building it: one object every part of the runner reads, so
that the worker sets each of them once (``SinkRunner.listening = ...``) whichever part needs it."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..observer import NULL_OBSERVER, Observer
from ..settings import RelaySettings


class Hooks:
    def __init__(self, settings: RelaySettings) -> None:
        self.settings = settings
        self.listening: Callable[[], bool] = lambda: False  # whether notifications reach the runner
        # Since when the worker's heartbeats have been reaching the database without a failure.
        self.reachable_since: Callable[[], float | None] = time.monotonic
        # Whether a deferrable cursor write may wait now: the worker makes it "while a long transaction
        # holds vacuum back" (horizon.py); alone, a runner defers whenever cursor_flush_seconds > 0.
        self.defer_writes: Callable[[], bool] = lambda: True
        self.observer: Observer = NULL_OBSERVER

    def idle_poll(self) -> float:
        """How long an idle runner waits for a wake-up before it reads again: long while LISTEN is up
        (notifications wake it; polling is the safety net), short while it is not."""
        return self.settings.listen_poll_seconds if self.listening() else self.settings.poll_seconds
