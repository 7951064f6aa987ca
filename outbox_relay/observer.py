"""What the relay engine reports as it works: batches, leases, failed cycles, housekeeping passes.

The engine calls an ``Observer``; it never imports a metrics or tracing library. The default does
nothing. ``metrics.PrometheusObserver`` turns the calls into Prometheus metrics (``outbox-relay run
--metrics-port``). Calls come from several threads (a runner per sink, membership, housekeeping), so an
implementation must be thread-safe; each call is cheap and never raises into the engine.
"""

from __future__ import annotations

from collections.abc import Sequence


class Observer:
    """No-op base: override what you need."""

    def batch(self, sink: str, *, size: int, delivered: int, retried: int, dead: int,
              latencies: Sequence[float]) -> None:
        """A batch's checkpoint landed: ``size`` events handled, of which ``delivered`` were delivered
        (``latencies``: seconds from each one's storing to the checkpoint, by the database's clock),
        ``retried`` failed and wait for a retry, ``dead`` were dead-lettered."""

    def leases(self, sink: str, *, acquired: int = 0, lost: int = 0, released: int = 0) -> None:
        """Buckets this relay leased, lost (fenced out: another relay took them over) or handed back."""

    def cycle_failed(self, sink: str, error: str) -> None:
        """A runner's cycle failed as a whole (it backs off and tries again)."""

    def producer_recreated(self, sink: str, reason: str) -> None:
        """A Kafka sink replaced its producer (broker amnesia, a fatal error, a stall)."""

    def housekeeping(self, *, seconds: float, dead_workers: int, expired_leases: int, deleted_events: int) -> None:
        """This relay ran a housekeeping pass."""


NULL_OBSERVER = Observer()
