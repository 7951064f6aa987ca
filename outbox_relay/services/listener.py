"""The listener service: LISTEN for wake-ups; on the relay that watches for commits (wakeups.py), also watch."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import psycopg

from ..dsn import redact
from ..housekeeping import application_name
from ..relay import SinkRunner
from ..settings import RelaySettings
from ..wakeups import MEMBERSHIP_CHANNEL, NOTIFY_CHANNEL, CommitWatcher
from .pool import RECONNECT
from .thread import ServiceThread
from .wake import read_everything, wake_owners

log = logging.getLogger("outbox_relay.worker")


class Listener(ServiceThread):
    """Wakes the runners that hold or want the notified buckets, with hints (polling stays the
    baseline); a membership notice brings the next heartbeat forward. Runs until ``stop``."""

    name = "listener"

    def __init__(self, settings: RelaySettings, runners: Sequence[SinkRunner], *, draining: threading.Event,
                 first_member: Callable[[], bool], membership_changed: Callable[[], None]) -> None:
        super().__init__()
        self.settings = settings
        self.runners = runners
        self._draining = draining  # the worker's: a draining relay hands watching over
        self._first_member = first_member
        self._membership_changed = membership_changed
        # Written by this thread, read by heartbeats and runners: `status` shows relays that only poll.
        self.listening = False
        self.watching = False  # ... and whether this relay is the one watching for commits

    def _lead(self, watcher: CommitWatcher) -> bool:
        try:
            return watcher.lead(self._first_member())
        except psycopg.Error as exc:
            if watcher.conn.broken or watcher.conn.closed:
                raise
            watcher.failed(exc)  # e.g. no EXECUTE on the watch function: listening goes on
            return False

    def run(self) -> None:
        s = self.settings
        dsn = s.dsn.get_secret_value()
        failures = 0
        while not self.stopped.is_set():
            try:
                with psycopg.connect(dsn, autocommit=True, application_name=application_name(s.worker_id)) as conn:
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    conn.execute(f"LISTEN {MEMBERSHIP_CHANNEL}")
                    self.listening = True
                    failures = 0
                    read_everything(self.runners)  # notifications may have been missed while disconnected
                    self._membership_changed()
                    watcher = CommitWatcher(conn, s.watch_interval_ms, s.watch_max_interval_ms)
                    own_pid = conn.info.backend_pid
                    while not self.stopped.is_set():
                        if self._draining.is_set():
                            watcher.step_down()  # a draining relay hands watching over
                        if not self._draining.is_set() and self._lead(watcher):
                            self.watching = True
                            try:
                                buckets = watcher.watch()
                            except psycopg.Error as exc:
                                if conn.broken or conn.closed:
                                    raise
                                watcher.failed(exc)  # e.g. cancelled: listening goes on
                                buckets = None
                            if buckets is not None:
                                wake_owners(self.runners, buckets)
                            notes = conn.notifies(timeout=0)  # those that arrived meanwhile
                        else:
                            self.watching = False
                            notes = conn.notifies(timeout=1.0, stop_after=1)
                        for note in notes:
                            if note.channel == MEMBERSHIP_CHANNEL:
                                self._membership_changed()
                            elif note.pid != own_pid:  # our own watch's buckets were handled above
                                wake_owners(self.runners, note.payload)
            except Exception as exc:
                self.listening = False
                self.watching = False
                if self.stopped.is_set():
                    return
                failures += 1
                delay = RECONNECT.delay(failures)
                log.warning("listener: %s: %s; polling until it reconnects (in %.0fs)", type(exc).__name__,
                            redact(str(exc)), delay)
                self.stopped.wait(delay)
