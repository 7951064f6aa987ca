"""How much of which bucket a runner reads next (runner thread only): per-bucket limits, the buckets to
read again whatever the hints say, the safety-net read of every bucket, and when the reads' snapshots
were taken (delivery latency)."""

from __future__ import annotations

from collections.abc import Iterable

from .. import store
from ..positions import Cursor, Snapshot
from ..sinks.engine import Sink
from ..store import Conn

MIN_BUCKET_LIMIT = 8


def read_limits(buckets: Iterable[int], saturated: set[int], batch_size: int, rotation: int) -> dict[int, int]:
    """Per-bucket read limits, in an order that rotates with ``rotation`` (the first buckets of a read
    are served first when the batch fills): the batch budget spread over the buckets, at least
    MIN_BUCKET_LIMIT each, and the buckets whose last read was full share it when that is more."""
    order = sorted(buckets)
    if not order:
        return {}
    base = max(MIN_BUCKET_LIMIT, batch_size // len(order))
    busy = saturated.intersection(order)
    hot = max(base, batch_size // max(1, len(busy)))
    start = rotation % len(order)
    return {b: hot if b in busy else base for b in order[start:] + order[:start]}


def fetch_events(conn: Conn, sink: Sink, worker: str, reads: dict[int, tuple[int, Cursor]],
                 fences: dict[int, int]) -> store.Read:
    """``store.fetch_events`` for ``sink`` (its event filter); the Kafka sink's reads carry its headers'
    ready-made values."""
    return store.fetch_events(conn, sink.name, worker, reads, sink.event_filter, formatted=sink.kind == "kafka",
                              fences=fences)


class ReadPlan:
    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        # Buckets read again next cycle whatever the hints say (``Delivery.deliver_new``).
        self.saturated: set[int] = set()
        self.full_read_at = 0.0  # monotonic time of the next read of every held bucket (the safety net)
        self.snapshots = SnapshotTimes()
        self._rotation = 0

    def bucket_limit(self, buckets: int) -> int:
        return max(MIN_BUCKET_LIMIT, self.batch_size // max(1, buckets))

    def limits(self, held: dict[int, int]) -> dict[int, int]:
        if not held:
            return {}
        self._rotation = (self._rotation + 1) % len(held)
        return read_limits(held, self.saturated, self.batch_size, self._rotation)


class SnapshotTimes:
    """Monotonic time each read snapshot was last taken, for the snapshots the runner's cursors may still
    hold (runner thread only). Bounded: the oldest are forgotten, which only loses precision."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._at: dict[Snapshot, float] = {}

    def taken(self, snapshot: Snapshot, at: float) -> None:
        # A snapshot equal to an earlier one means no transaction ended in between: what it does not
        # show was still invisible at the later read, so the later time is the tighter bound.
        self._at.pop(snapshot, None)
        if len(self._at) >= self.LIMIT:
            for old in list(self._at)[: self.LIMIT // 2]:  # insertion order: the oldest first
                del self._at[old]
        self._at[snapshot] = at

    def at(self, snapshot: Snapshot) -> float | None:
        return self._at.get(snapshot)
