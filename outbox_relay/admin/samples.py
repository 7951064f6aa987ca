"""Per-minute samples of every sink's backlog (outbox.console_samples), so that a chart of the last hour
needs nothing but the database. A running console takes one a minute (``take_sample``); a day is kept."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from ..backlog import backlog
from .table import Conn, fetch_table

SAMPLES_READ = 20_000  # rows of one read: 64 sinks x 61 minutes, with room


@dataclass(frozen=True)
class Sample:
    sink: str
    at: datetime
    pending: int
    parked: int
    dead_letters: int
    published: int  # events stored in the minute before ``at`` (every topic)


def take_sample(conn: Conn) -> datetime:
    """Store this minute's sample of every live sink (the backlog, and the events stored in the minute
    before) and trim samples older than a day; a second console sampling the same minute stores nothing.
    Returns the minute."""
    with conn.transaction():
        minute: datetime = fetch_table(conn, "sample_minute", group="console").rows[0][0]
        published = fetch_table(conn, "published_between", {"since": minute - timedelta(minutes=1),
                                                            "until": minute}, group="console").rows[0][0]
        for b in backlog(conn):
            fetch_table(conn, "sample_store", {"sink": b.sink, "at": minute, "pending": b.pending,
                                               "parked": b.parked + b.paused, "dead_letters": b.dead_letters,
                                               "published": published}, group="console")
        fetch_table(conn, "sample_trim", group="console")
    return minute


def samples_since(conn: Conn, minutes: int = 61) -> list[Sample]:
    """Every sink's samples of the last ``minutes``, oldest first."""
    rows = fetch_table(conn, "samples_since", {"minutes": minutes, "limit": SAMPLES_READ}, group="console").rows
    return sorted((Sample(*r) for r in rows), key=lambda s: (s.at, s.sink))
