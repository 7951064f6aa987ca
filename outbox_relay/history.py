"""History: the partitions of ``outbox.events`` and retention by class (docs/history.md).

Housekeeping keeps a range partition ahead of the transactions being written (``make_ahead``) and
removes whole partitions that every sink has passed and whose retention class has let go of them
(``retire``); no event row is ever deleted. The operator actions (classes, topics, rolling the
current partition) are functions here; the CLI only parses and prints.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from .errors import ConfigurationError
from .sqlfiles import query
from .store import Conn

log = logging.getLogger("outbox_relay.history")

# A new range covers about --partition-seconds at the transaction rate seen since the last one was
# made, and never fewer ids than this (a quiet database would otherwise make a range per pass).
MIN_PARTITION_XIDS = 10_000
# How long a partition change waits for the events table's lock before giving up until the next pass:
# while it waits, every producer and relay queues behind it.
LOCK_TIMEOUT_MS = 500
# How long `retention roll` keeps asking for that lock (a long transaction on the table holds it off).
ROLL_WAIT_SECONDS = 30.0
_CLASS = re.compile(r"^[a-z][a-z0-9_]{0,29}\Z")
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}\Z")


@dataclass(frozen=True)
class Retired:
    partition: str
    events: int


def make_ahead(conn: Conn, seconds: float, min_width: int = MIN_PARTITION_XIDS) -> list[str]:
    """Create range partitions until one is ahead of the transactions being written; returns their
    names. A lock not granted in time leaves it to the next pass (inserts land in events_default)."""
    made: list[str] = []
    for _ in range(3):
        try:
            with conn.transaction():
                conn.execute(query("history", "lock_timeout"), {"ms": LOCK_TIMEOUT_MS})
                row = conn.execute(query("history", "add_partition"),
                                   {"min_width": min_width, "seconds": seconds}).fetchone()
        except psycopg.errors.LockNotAvailable:
            log.info("history: the events table was busy; the next partition is made at the next pass")
            break
        if row is None or row[0] is None:
            break
        made.append(str(row[0]))
    return made


def retire(conn: Conn, retention_seconds: float, budget_seconds: float) -> list[Retired]:
    """Store ``retention_seconds`` as the default class's keep (0019: all that retention goes by), drop
    partitions that may go, oldest first, each in its own short transaction, within a time budget; then
    release the copies of parked and dead-lettered events (0015) that nothing names any more."""
    conn.execute(query("history", "store_default_keep"), {"retention": retention_seconds})
    done: list[Retired] = []
    deadline = time.monotonic() + budget_seconds
    while time.monotonic() < deadline:
        try:
            with conn.transaction():
                conn.execute(query("history", "lock_timeout"), {"ms": LOCK_TIMEOUT_MS})
                row = conn.execute(query("history", "retire_partition")).fetchone()
        except psycopg.errors.LockNotAvailable:
            log.info("history: the events table was busy; retention goes on at the next pass")
            break
        if row is None:
            break
        done.append(Retired(str(row[0]), int(row[1] or 0)))
    # Copies of parked and dead-lettered events from dropped partitions that no retry needs any more.
    row = conn.execute(query("history", "release_kept_events")).fetchone()
    if row and row[0]:
        log.info("history: %d kept copies of events released (their dead letters or parked rows are gone)", row[0])
    return done


def roll(conn: Conn, seconds: float, min_width: int = MIN_PARTITION_XIDS,
         wait_seconds: float = ROLL_WAIT_SECONDS) -> str:
    """End the partition being written now and start the next one (class changes apply from it). Waits
    for the events table's lock LOCK_TIMEOUT_MS at a time, up to ``wait_seconds`` in all: every producer
    and relay queues behind a lock request while it waits, so they go on between the attempts."""
    deadline = time.monotonic() + wait_seconds
    pause = 0.05
    while True:
        try:
            with conn.transaction():
                conn.execute(query("history", "lock_timeout"), {"ms": LOCK_TIMEOUT_MS})
                row = conn.execute(query("history", "roll_partition"),
                                   {"min_width": min_width, "seconds": seconds}).fetchone()
            break
        except psycopg.errors.LockNotAvailable:
            if time.monotonic() + pause >= deadline:
                raise
            log.info("history: the events table is busy (a long reader or writer); the roll tries again")
            time.sleep(pause)  # producers and relays take their turn
            pause = min(2 * pause, 1.0)
    assert row is not None and row[0] is not None  # roll always makes a range
    return str(row[0])


def check_class_name(name: str) -> str:
    if not _CLASS.match(name):
        raise ConfigurationError(f"retention class name {name!r} is invalid: 1-30 of a-z 0-9 _, starting with a letter")
    return name


def set_class(conn: Conn, name: str, keep_seconds: float | None) -> None:
    """Create a class or change its keep (None: for good). 'default' overrides --retention-seconds."""
    check_class_name(name)
    if keep_seconds is not None and keep_seconds < 0:
        raise ConfigurationError(f"retention class {name!r}: keep must be >= 0 seconds, not {keep_seconds}")
    conn.execute(query("history", "set_class"), {"name": name, "keep": keep_seconds})


def reset_default(conn: Conn) -> None:
    """The default class keeps the relays' --retention-seconds again."""
    conn.execute(query("history", "reset_default"))


def drop_class(conn: Conn, name: str) -> None:
    check_class_name(name)
    if name == "default":
        raise ConfigurationError("the default class can not be dropped (reset its keep instead)")
    if conn.execute(query("history", "drop_class"), {"name": name}).fetchone() is None:
        raise ConfigurationError(f"retention class {name!r} does not exist, or topics or partitions still use it")


def map_topic(conn: Conn, topic: str, class_name: str) -> None:
    """Put a topic in a class ('default': back to the default class); applies from the next partition."""
    if not _TOPIC.match(topic) or topic in (".", ".."):
        raise ConfigurationError(f"topic {topic!r} is not a Kafka topic name (1-249 of A-Z a-z 0-9 . _ -)")
    check_class_name(class_name)
    if class_name == "default":
        conn.execute(query("history", "unmap_topic"), {"topic": topic})
        return
    row = conn.execute(query("history", "class_exists"), {"name": class_name}).fetchone()
    if not row or not row[0]:
        raise ConfigurationError(f"retention class {class_name!r} does not exist: create it first")
    conn.execute(query("history", "map_topic"), {"topic": topic, "class": class_name})


def rows(conn: Conn, name: str, retention_seconds: float) -> tuple[list[str], list[tuple[Any, ...]]]:
    """The rows of a report query (classes, by_class, partitions) with their column names."""
    cur = conn.execute(query("history", name), {"retention": retention_seconds})
    return [d.name for d in cur.description or ()], [tuple(r) for r in cur.fetchall()]
