"""What a sink should have received, read from the store: its registration, what retention removed of
its topics, and its stored events bucket by bucket in bounded pages (``sql/queries/verify.sql``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from ..admin.sink_lifecycle import no_such_sink
from ..sqlfiles import query
from .check import Stored

BUCKETS = 256
PAGE = 5_000  # events per read: a bucket of any size is read in pages of this many

Conn = psycopg.Connection[Any]


@dataclass(frozen=True)
class SinkRecord:
    name: str
    kind: str
    topics: tuple[str, ...] | None  # None: every topic
    removed_events: int  # of its topics, removed by retention
    removed_through: datetime | None
    commit_times: bool  # the server records commit times (track_commit_timestamp)
    default_topic: str | None = None  # a Kafka sink's: where events without a topic go


def sink_record(conn: Conn, sink: str) -> SinkRecord:
    """The sink as registered; ConfigurationError for one that does not exist or was dropped."""
    row = conn.execute(query("verify", "sink"), {"sink": sink}).fetchone()
    if row is None or row[2]:
        raise no_such_sink(conn, sink)
    kind, topics, _ = row
    removed, through = conn.execute(query("verify", "removed"), {"topics": topics}).fetchone() or (0, None)
    (commit_times,) = conn.execute(query("verify", "commit_times")).fetchone() or (False,)
    return SinkRecord(sink, kind, tuple(topics) if topics is not None else None, int(removed), through,
                      bool(commit_times))


def stored_topics(conn: Conn) -> list[str]:
    """Every topic stored events have (a pass over the history)."""
    return [r[0] for r in conn.execute(query("verify", "topics"))]


def buckets(conn: Conn, sink: SinkRecord, page: int = PAGE) -> Iterator[list[Stored]]:
    """Each bucket's stored events in position order (each key's with them), read ``page`` at a time."""
    for bucket in range(BUCKETS):
        events: list[Stored] = []
        after: tuple[int, int] = (0, 0)
        while True:
            rows = _page(conn, sink, bucket, after, page)
            events.extend(Stored(r[0], r[1], int(r[2]), int(r[3]), r[4], r[5], r[6]) for r in rows)
            if len(rows) < page:
                break
            after = (int(rows[-1][2]), int(rows[-1][3]))
        yield events


def _page(conn: Conn, sink: SinkRecord, bucket: int, after: tuple[int, int], limit: int) -> Sequence[Any]:
    topics = list(sink.topics) if sink.topics is not None else None
    return conn.execute(query("verify", "stored_page"), {
        "sink": sink.name, "topics": topics, "bucket": bucket, "after_xid": str(after[0]), "after_seq": after[1],
        "limit": limit, "commit_times": sink.commit_times,
        "default_topic": sink.default_topic}).fetchall()
