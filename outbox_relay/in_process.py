"""A relay inside your own process: the engine ``outbox-relay run`` runs, started and stopped by you.

    from outbox_relay import Relay, RelaySettings

    relay = Relay(RelaySettings(dsn=DSN, kafka=False, worker_id="api-1"), sinks=[AuditSink()])
    relay.start()            # registers with the other relays, takes its share of buckets, delivers
    ...
    relay.drain()            # leaves the assignment, finishes the batch in flight, releases, returns

or ``with Relay(...) as relay:`` (start, then drain on the way out). Several ``Relay`` objects in one
process are several relay members (give each its own ``worker_id``): they split the buckets between
them as separate processes would, which is how projections with slow handlers get concurrency across
keys; an ``EventSink`` gets it within one relay from its ``concurrency`` attribute (docs/writing-a-sink.md).

A ``Relay`` installs no signal handlers (the process is yours) and never ends the process: a sink that
does not return even after a hard stop is left behind (logged), and ``stop`` returns.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType

from .errors import OutboxError
from .observer import Observer
from .settings import RelaySettings
from .worker import Worker


class Relay:
    """One relay member in this process: the sinks its settings name (Kafka, ``projection``, ``sink``),
    plus ``sinks`` (``EventSink`` objects, or engine sinks such as ``testing.RecordingSink``), reporting
    to ``observer`` (e.g. ``Observer.checkpointed``: a batch's checkpoint committed)."""

    def __init__(self, settings: RelaySettings, *, sinks: Sequence[object] = (),
                 observer: Observer | None = None) -> None:
        from .compose import build_worker  # the sinks' modules only when a relay is built

        self.settings = settings
        self.worker: Worker = build_worker(settings, sinks, observer)
        self._waiter: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """Started and not yet stopped (draining counts as running)."""
        return self._waiter is not None and self._waiter.is_alive()

    @property
    def fatal(self) -> OutboxError | None:
        """Why the relay stopped by itself (a sink was dropped, a sink stuck past recovery), else None."""
        return self.worker.fatal

    def start(self) -> None:
        """Connect, register, start delivering on background threads, return. Waits (retrying) while the
        database is unreachable; raises ConfigurationError or SchemaError for what no retry fixes."""
        if self._waiter is not None:
            raise OutboxError("this Relay was started already (make a new one to start again)")
        if not self.worker.start():
            return
        self._waiter = threading.Thread(target=self.worker.wait, name=f"relay-{self.worker.id}", daemon=True)
        self._waiter.start()

    def drain(self, timeout: float | None = None) -> bool:
        """Graceful stop: leave the assignment, stop claiming, finish or release what is in flight (a hard
        stop after ``drain_seconds``), then return. True once stopped; False if ``timeout`` passed first."""
        self.worker.drain()
        return self.wait(timeout)

    def stop(self, timeout: float | None = None) -> bool:
        """Hard stop: drop the batches in flight (the next owner delivers them again), release, return."""
        self.worker.stop_hard()
        return self.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the relay stopped (after ``drain``/``stop``, or by itself: see ``fatal``). False on timeout."""
        if self._waiter is not None:
            self._waiter.join(timeout)
            return not self._waiter.is_alive()
        return True

    def health(self) -> list[str]:
        """Why the relay is not alive and in touch with its database; empty when it is."""
        return self.worker.health()

    def readiness(self) -> list[str]:
        """Why the relay is not doing its share (buckets not leased yet, a stuck or unreachable sink)."""
        return self.worker.readiness()

    def __enter__(self) -> Relay:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.drain()


__all__ = ["Relay"]
