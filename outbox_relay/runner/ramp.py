"""Crash-loop suspects (runner thread only): the buckets delivered a few events at a time, and what
made them suspects. Pure state; ``prober.py`` acts on it."""

from __future__ import annotations

from collections.abc import Iterable

from ..crashloop import FIRST_PROBE, HEALTHY
from ..store import Acquired


class Ramp:
    def __init__(self) -> None:
        self._sizes: dict[int, int] = {}  # bucket -> events per probe (0 or absent: not a suspect)
        self.suspects: set[int] = set()  # the buckets whose size is above 0 (a cycle looks at these, not at all)
        # Buckets this process has held: one it takes in its own worker id without having held it is a
        # restart's (the last process of that id died holding it).
        self._held_ever: set[int] = set()
        # Per suspect, the deaths counted before its probe, charged to the first event probed alone.
        self._deaths: dict[int, int] = {}

    def size(self, bucket: int) -> int:
        return self._sizes.get(bucket, 0)

    def suspect(self, bucket: int) -> bool:
        return bool(self._sizes.get(bucket))

    def deaths(self, bucket: int) -> int:
        return self._deaths.get(bucket, 0)

    def restarted(self, wanted: set[int]) -> set[int]:
        """Of ``wanted``, the buckets this process never held."""
        return wanted - self._held_ever

    def acquired(self, acquired: dict[int, Acquired], max_lapses: int) -> list[int]:
        """Take up newly acquired buckets; returns the suspects among them (lapsed ``max_lapses``+ times)."""
        self._held_ever |= acquired.keys()
        suspects = sorted(b for b, a in acquired.items() if a.lapses >= max_lapses)
        self._sizes.update({b: FIRST_PROBE if b in suspects else HEALTHY for b in acquired})
        self.suspects = (self.suspects - acquired.keys()) | set(suspects)
        self._deaths.update({b: a.lapses if b in suspects else 0 for b, a in acquired.items()})
        return suspects

    def isolate(self, buckets: Iterable[int]) -> None:
        """A batch of these buckets failed as a whole: deliver them one event at a time."""
        buckets = set(buckets)
        self._sizes.update({b: FIRST_PROBE for b in buckets})
        self.suspects |= buckets

    def grow(self, bucket: int, size: int) -> None:
        self._sizes[bucket] = size
        if size:
            self.suspects.add(bucket)
        else:
            self.suspects.discard(bucket)

    def healthy(self, bucket: int) -> None:
        self._sizes[bucket] = HEALTHY
        self.suspects.discard(bucket)
        self._deaths.pop(bucket, None)
