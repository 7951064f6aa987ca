"""The lease keeper: takes up and hands back a runner's buckets as the assignment says (runner thread),
and renews them or, for a stuck runner, gives them up (membership thread)."""

from __future__ import annotations

import logging
import threading
import time

from psycopg_pool import ConnectionPool

from .. import store
from ..settings import RelaySettings
from ..store import Conn
from .checkpoints import CheckpointWriter
from .cursors import CursorBook
from .health import Progress
from .hints import Hints
from .hooks import Hooks
from .leases import Leases, Losses
from .parked import ParkSchedule
from .ramp import Ramp

log = logging.getLogger("outbox_relay.relay")  # every part of the runner logs as the relay


class LeaseKeeper:
    def __init__(self, sink_name: str, worker: str, pool: ConnectionPool[Conn], settings: RelaySettings, *,
                 leases: Leases, losses: Losses, writer: CheckpointWriter, book: CursorBook, ramp: Ramp,
                 hints: Hints, park: ParkSchedule, progress: Progress, hooks: Hooks,
                 draining: threading.Event) -> None:
        self.sink_name = sink_name
        self.worker = worker
        self.pool = pool
        self.settings = settings
        self.leases = leases
        self.losses = losses
        self.writer = writer
        self.book = book
        self.ramp = ramp
        self.hints = hints
        self.park = park
        self.progress = progress
        self.hooks = hooks
        self.draining = draining

    def rebalance(self, desired: set[int] | None) -> None:
        if desired is None:
            return
        held = self.leases.snapshot()
        surplus = {b: held[b] for b in held.keys() - desired}
        if not surplus and (self.draining.is_set() or desired <= held.keys()):
            return  # the usual cycle: nothing to hand over or take
        if surplus:
            self.writer.flush_ahead(surplus)  # after the waiting fence check, if any (``settle_pending``)
        # One connection at a time per thread (the pool may hold just one): nothing below checks out another.
        with self.pool.connection() as conn:
            if surplus:
                store.announce_buckets(conn, store.release_leases(conn, self.sink_name, self.worker, surplus))
                self.leases.drop(surplus.keys(), surplus)
                self.hooks.observer.leases(self.sink_name, released=len(surplus))
                log.info("sink %s: released %d buckets", self.sink_name, len(surplus))
            wanted = desired - held.keys()
            if wanted and not self.draining.is_set():
                acquired = store.acquire_leases(conn, self.sink_name, self.worker, wanted,
                                                self.settings.lease_seconds, restarted=self.ramp.restarted(wanted))
                if not acquired and not held:
                    # Nothing to hold and nothing to take: normal while buckets change hands, but also what
                    # a dropped sink looks like (its cursors are gone). Never idle silently on one.
                    store.require_live_sink(self.sink_name, store.sink_state(conn, self.sink_name))
                suspects = self.ramp.acquired(acquired, self.settings.max_lapses)
                if acquired:
                    self.hints.add(acquired)  # they may come with a backlog
                    self.hooks.observer.leases(self.sink_name, acquired=len(acquired))
                    self.leases.add({b: a.fence for b, a in acquired.items()})
                    self.book.acquired(acquired, time.monotonic())  # the acquisition wrote the rows
                    self.park.now()  # new buckets may come with parked keys
                    log.info("sink %s: acquired %d buckets", self.sink_name, len(acquired))
                    if suspects:
                        log.warning("sink %s: buckets %s lapsed %d+ times with work pending (a crash loop?): "
                                    "delivering them one event at a time", self.sink_name, suspects,
                                    self.settings.max_lapses)

    def renew(self) -> None:
        """Called by the membership thread: extend every lease, forget the lost ones. A stuck runner's
        leases are released instead, so that other relays take its buckets now (fences keep what it
        still does from landing)."""
        fences = self.leases.snapshot()
        stuck = self.progress.stuck()
        if stuck is None:
            if self.progress.gave_up:
                self.progress.gave_up = False
                log.warning("sink %s: the runner makes progress again; it takes buckets again", self.sink_name)
        elif not self.progress.gave_up:
            self.progress.gave_up = True
            log.error("sink %s: the runner is stuck (%s); releasing its %d buckets so that other relays take them",
                      self.sink_name, stuck, len(fences))
        if not fences:
            return
        observer = self.hooks.observer
        if stuck is not None:
            with self.pool.connection() as conn:
                store.announce_buckets(conn, store.release_leases(conn, self.sink_name, self.worker, fences))
            self.leases.drop(fences.keys(), fences)
            observer.leases(self.sink_name, lost=len(fences))
            return
        with self.pool.connection() as conn:
            kept = store.renew_leases(conn, self.sink_name, self.worker, fences, self.settings.lease_seconds)
        lost = set(fences) - kept
        if lost:
            observer.leases(self.sink_name, lost=len(lost))
            self.losses.tell(lost, "lost the lease on %d buckets (fenced out)")
            self.leases.drop(lost, fences)

    def release_all(self) -> None:
        """Hand every bucket back (a stop or a drain), its cursors written first."""
        fences = self.leases.snapshot()
        if not fences:
            return
        try:
            self.writer.flush_ahead(fences)
            with self.pool.connection() as conn:
                store.announce_buckets(conn, store.release_leases(conn, self.sink_name, self.worker, fences))
            self.hooks.observer.leases(self.sink_name, released=len(fences))
            log.info("sink %s: released all %d buckets", self.sink_name, len(fences))
        except Exception as exc:
            log.warning("sink %s: could not release leases (%s); they will expire", self.sink_name, exc)
        self.leases.drop(fences.keys(), fences)
