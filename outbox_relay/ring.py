"""Consistent-hash ring with virtual nodes over the partition buckets.

Pure and deterministic: every worker that sees the same live set computes the same owner
for every bucket, and adding a worker moves only the buckets that land on its points
(about 1/(N+1) of them).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable

BUCKETS = 256  # must match outbox.bucket_v1 and the cursors CHECK in sql/


def _point(label: str) -> int:
    return int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "big")


class Ring:
    def __init__(self, workers: Iterable[str], vnodes: int = 64) -> None:
        self.workers = tuple(sorted(set(workers)))
        points = sorted((_point(f"{w}#{i}"), w) for w in self.workers for i in range(vnodes))
        self._keys = [p for p, _ in points]
        self._owners = [w for _, w in points]

    def owner(self, bucket: int) -> str | None:
        if not self._keys:
            return None
        i = bisect.bisect(self._keys, _point(f"bucket:{bucket}")) % len(self._keys)
        return self._owners[i]

    def buckets_of(self, worker: str) -> set[int]:
        return {b for b in range(BUCKETS) if self.owner(b) == worker}

    def assignment(self) -> dict[int, str | None]:
        return {b: self.owner(b) for b in range(BUCKETS)}
