"""When a runner looks at its parked events next."""

from __future__ import annotations

import time

# A notification on the events channel that says an operator changed a parked key in a bucket
# (outbox-relay keys retry|skip|resume; sql/queries/admin.sql, notify_parked): "parked:<bucket>".
# Its owner then looks at the park at once instead of at its next retry time.
PARKED_NOTICE = "parked:"
# With nothing parked and notifications arriving, how often a runner looks at the park anyway. What
# parks an event tells the runner (its own checkpoint, a bucket acquired, a blocked read, an operator's
# PARKED_NOTICE); this is the safety net for a park changed by hand without one.
PARK_CHECK_IDLE_SECONDS = 60.0


class ParkSchedule:
    """The monotonic time of the runner's next look at its park (runner thread only)."""

    def __init__(self) -> None:
        self.check_at = 0.0

    def now(self) -> None:
        """Something parked an event or may have: look at the next cycle."""
        self.check_at = 0.0

    def after(self, seconds: float) -> None:
        self.check_at = time.monotonic() + max(0.0, seconds)

    def due(self) -> bool:
        return time.monotonic() >= self.check_at

    def until(self) -> float:
        return max(0.0, self.check_at - time.monotonic())
