"""Whether a runner makes progress: written by the runner thread, read by the membership thread and the
health checks."""

from __future__ import annotations

import time

from .gate import Pulse
from .hooks import Hooks


class Progress:
    def __init__(self, abort: Pulse, hooks: Hooks, limit_seconds: float) -> None:
        self.abort = abort
        self.hooks = hooks
        self.limit = limit_seconds
        self.idle = True  # waiting for work (or not running): never stuck
        self.failing_since: float | None = None  # monotonic time of the first failed cycle in a row
        self.gave_up = False  # the membership thread released the leases of this stuck runner

    def cycle_ok(self) -> None:
        self.failing_since = None

    def cycle_failed(self) -> None:
        if self.failing_since is None:
            self.failing_since = time.monotonic()

    def stuck(self) -> str | None:
        """Why the runner counts as stuck; None while it makes progress or waits for work."""
        now = time.monotonic()
        if not self.idle and now - self.abort.last > self.limit:
            return f"no progress for {now - self.abort.last:.0f}s (its sink has not returned)"
        failing = self.failing_since
        # Only while the database answers the membership thread: in an outage every runner fails, and
        # giving every bucket up would only move them all when it ends.
        reachable = self.hooks.reachable_since()
        if failing is not None and reachable is not None and now - max(failing, reachable) > self.limit:
            return f"every cycle failed for {now - failing:.0f}s"
        return None
