"""Buckets notifications said were written: the listener thread adds, the runner takes."""

from __future__ import annotations

import threading
from collections.abc import Iterable


class Hints:
    """Buckets that notifications said were written since the runner last read them: the listener
    thread adds, the runner takes. Until something says otherwise (start, a lost LISTEN connection,
    a payload that names no buckets), every bucket counts as written."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: set[int] = set()
        self._everything = True

    def add(self, buckets: Iterable[int]) -> None:
        with self._lock:
            self._buckets.update(buckets)

    def everything(self) -> None:
        with self._lock:
            self._everything = True

    def take(self) -> set[int] | None:
        """The hinted buckets, cleared; None: read every bucket."""
        with self._lock:
            if self._everything:
                self._everything = False
                self._buckets.clear()
                return None
            taken, self._buckets = self._buckets, set()
            return taken
