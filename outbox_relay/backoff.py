"""Exponential backoff with jitter, in one place so tests can shrink it."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    base: float = 1.0
    cap: float = 600.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait after the given (1-based) failed attempt: uniform in [d/2, d]."""
        # Clamp the exponent: 2.0 ** 1024 overflows a float long before the cap would apply.
        ceiling = min(self.cap, self.base * 2.0 ** min(max(0, attempt - 1), 64))
        return ceiling / 2 + random.random() * ceiling / 2
