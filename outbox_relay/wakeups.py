"""Wake-ups without producer NOTIFY: one relay per deployment watches for commits.

Producers write plain INSERTs and notify nobody (migration 0010): a NOTIFY in the producer's
transaction serialised every publishing commit on the server and ruled out PREPARE TRANSACTION.
Instead, the relay that holds an advisory lock (``WATCH_LOCK``) on its LISTEN connection calls
``outbox.watch_commits_v1`` in a loop. The function sleeps in the server, looks every
``--watch-interval-ms`` for transactions that wrote events and have committed since its last look
(a short index range on ``events.xid``), and returns with their buckets after sending the same
``NOTIFY outbox_events_v2`` the trigger used to send, so every relay's listener wakes the owners as
before. Idle, it costs one statement per ``WATCH_WAIT_MS`` on one relay, and the looks back off
(``WatchPace``): every call that found nothing doubles the interval of the next, up to
``--watch-max-interval-ms``; the first commit found brings it back to ``--watch-interval-ms``.

Who watches: whichever listening relay takes the lock first. The lock is session-level, so a relay
that dies or loses its connection frees it at once; the first live member of a sink (the relay that
also runs housekeeping) tries to take it every ``LEAD_RETRY_FIRST`` seconds, the others every
``LEAD_RETRY_OTHERS``. Polling (``--listen-poll-seconds``) stays the safety net while nobody watches.
"""

from __future__ import annotations

import contextlib
import logging
import time

import psycopg

from .dsn import redact
from .sqlfiles import query
from .store import Conn

log = logging.getLogger("outbox_relay.wakeups")

NOTIFY_CHANNEL = "outbox_events_v2"  # payload: buckets written, comma-separated ("*": all)
MEMBERSHIP_CHANNEL = "outbox_membership_v1"  # payload: a sink whose assignment changed
WATCH_LOCK = 0x6F7574626F7877  # "outboxw": advisory lock of the relay that watches for commits
WATCH_WAIT_MS = 1000  # one call returns after this long without a commit (then notifications are read)
LEAD_RETRY_FIRST = 1.0  # seconds between tries to lead, for a sink's first live member
LEAD_RETRY_OTHERS = 20.0  # ... for every other listening relay (a first member that does not listen)
WATCH_RETRY_AFTER_ERROR = 60.0  # seconds before a relay whose watch failed tries to lead again
# Under load, the longest wait between two watch calls (``WatchPace.gap_ms``): what a wake-up may add to
# a commit's latency while commits keep coming, against a call, a scan and a NOTIFY per commit.
BUSY_GAP_MAX_MS = 4.0


class WatchPace:
    """How often the watch looks: every ``shortest_ms`` while commits come; each call (up to
    WATCH_WAIT_MS) that found none doubles the next call's interval up to ``longest_ms``, so that an
    idle server is not woken every millisecond; the first commit found brings it back at once. Per
    call, not per look: commits a second apart keep the shortest interval.

    Under load, commits come faster than one per look and every call returns at its first look: a
    call, a scan and a NOTIFY per commit or two, each waking the owners again while they are still busy
    with the last batch. ``gap_ms`` then spaces the calls, doubling up to ``BUSY_GAP_MAX_MS`` while calls
    keep finding commits at once, so that a call gathers the commits of a few milliseconds; a call that
    had to wait (commits sparser than the looks) brings it back to none."""

    def __init__(self, shortest_ms: int, longest_ms: int) -> None:
        self.shortest_ms = shortest_ms
        self.longest_ms = max(shortest_ms, longest_ms)
        self.interval_ms = shortest_ms
        self.gap_ms = 0.0  # wait before the next call (in the client): commits come faster than the looks

    def after(self, found: bool, at_once: bool = False) -> int:
        """The interval of the next call, after one that found commits (or none); ``at_once``: at its
        first look, without waiting."""
        self.interval_ms = self.shortest_ms if found else min(self.longest_ms, 2 * self.interval_ms)
        self.gap_ms = min(BUSY_GAP_MAX_MS, max(self.shortest_ms, 2 * self.gap_ms)) if found and at_once else 0.0
        return self.interval_ms

    def reset(self) -> None:
        self.interval_ms = self.shortest_ms
        self.gap_ms = 0.0


class CommitWatcher:
    """The watching side of one relay's LISTEN connection; owned by the listener thread."""

    def __init__(self, conn: Conn, interval_ms: int, max_interval_ms: int | None = None) -> None:
        self.conn = conn
        self.pace = WatchPace(interval_ms, interval_ms if max_interval_ms is None else max_interval_ms)
        self.looks = 0  # calls of the watch function so far (tests count them)
        self.leading = False
        self._since: str | None = None  # snapshot of the last look (text)
        self._last_try = -LEAD_RETRY_OTHERS  # monotonic time of the last try to lead (none yet)
        self._pause_until = 0.0  # after an error other than a lost connection: no try before this
        self._wait_ms = WATCH_WAIT_MS

    def lead(self, first_member: bool) -> bool:
        """Whether this relay watches now; tries to take the lock when it is due."""
        if self.leading:
            return True
        now = time.monotonic()
        # Due by the relay's role now: one that has just become a first member tries within a second.
        if now >= max(self._pause_until, self._last_try + (LEAD_RETRY_FIRST if first_member else LEAD_RETRY_OTHERS)):
            self._last_try = now
            row = self.conn.execute(query("wakeups", "lead"), {"lock": WATCH_LOCK}).fetchone()
            self.leading = bool(row and row[0])
            if self.leading:
                self._since = None
                self.pace.reset()
                # A statement_timeout or transaction_timeout (PostgreSQL 17) of the relay's role or
                # database below WATCH_WAIT_MS would cancel every wait: wait at most half of it.
                limit = self.conn.execute(query("wakeups", "timeout_ms")).fetchone()
                self._wait_ms = min(WATCH_WAIT_MS, int(limit[0]) // 2) if limit and limit[0] else WATCH_WAIT_MS
                log.info("watching for commits (this relay wakes the others)")
        return self.leading

    def step_down(self) -> None:
        if self.leading:
            self.conn.execute(query("wakeups", "step_down"), {"lock": WATCH_LOCK})
            self.leading = False

    def failed(self, exc: psycopg.Error) -> None:
        """A watch or a try to lead failed, with the connection still up (no EXECUTE on the function, a
        cancelled statement...): give the lock up and try again in a minute; listening goes on."""
        log.warning("cannot watch for commits (%s: %s); trying again in %.0fs, other relays may watch meanwhile",
                    type(exc).__name__, redact(str(exc)), WATCH_RETRY_AFTER_ERROR)
        self._pause_until = time.monotonic() + WATCH_RETRY_AFTER_ERROR
        with contextlib.suppress(psycopg.Error):
            self.step_down()
        self.leading = False

    def watch(self) -> str | None:
        """Wait (at most WATCH_WAIT_MS) for commits since the last look; the buckets they wrote, or None."""
        if self.pace.gap_ms:
            time.sleep(self.pace.gap_ms / 1000)
        self.looks += 1
        started = time.monotonic()
        row = self.conn.execute(query("wakeups", "watch"), {
            "since": self._since, "wait_ms": self._wait_ms, "interval_ms": self.pace.interval_ms}).fetchone()
        if row is None:
            return None
        first = self._since is None  # the call that only took a snapshot says nothing about commits
        self._since = row[0]
        if not first:
            at_once = time.monotonic() - started < self.pace.interval_ms / 1000
            self.pace.after(found=row[1] is not None, at_once=at_once)
        return row[1]  # type: ignore[no-any-return]
