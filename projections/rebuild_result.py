"""What a rebuild (rebuild.py) reports once it switched over."""

from __future__ import annotations

from dataclasses import dataclass

from .decisions import WaitingKey


@dataclass(frozen=True)
class RebuildResult:
    projection: str
    events: int  # events the rebuild replayed (this run and, when resumed, earlier ones)
    seconds: float  # this run
    resumed: bool
    # After the switch: keys that still wait (a failing head, or a pause), and what live processing had
    # decided that the new model could not keep (said before the swap, too, in the log).
    waiting: tuple[WaitingKey, ...] = ()
    dropped: tuple[str, ...] = ()

    @property
    def failing(self) -> tuple[WaitingKey, ...]:
        return tuple(w for w in self.waiting if not w.paused)

    @property
    def clean(self) -> bool:
        """The new model is what live processing reached, with no key of it still failing."""
        return not self.failing and not self.dropped
