"""``verify``: one sink's stored history against what a reader got back from it (``Report``).

The order of reads is what makes a check of a live system sound: the sink's records and its stored
events are read in one REPEATABLE READ snapshot taken *before* the sink is read back, so every event
its cursors call delivered was acknowledged before the reading began and must be found. An id read back
that the snapshot does not hold is looked up once more at the end: stored since, it is only not yet
checkpointed. The snapshot's transaction stays open for the whole check (it holds vacuum back as long).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import psycopg

from ..errors import ConfigurationError
from ..settings import RelaySettings
from ..sqlfiles import query
from .check import SAMPLE, Check, Report
from .readers import check_kind, describe, read_back
from .stored import PAGE, SinkRecord, buckets, sink_record, stored_topics

TIMEOUT_SECONDS = 5.0


def verify(conn: psycopg.Connection[Any], sink: str, settings: RelaySettings, *,
           topics: Sequence[str] | None = None, timeout_seconds: float = TIMEOUT_SECONDS, sample: int = SAMPLE,
           page: int = PAGE) -> Report:
    """Check sink ``sink``: ``settings`` say how to reach its broker (the relays' settings); ``topics``
    limits which topics' destinations are read back (default: those it reads, else every stored topic);
    ``conn`` is a connection in autocommit mode. ConfigurationError for a sink verify can not read."""
    if not conn.autocommit:
        raise ConfigurationError("verify needs a connection in autocommit mode (it runs its own transaction)")
    with conn.transaction():
        conn.execute(query("verify", "begin_snapshot"))
        record = sink_record(conn, sink)
        check_kind(record.kind, sink)
        report = Report(sink, record.kind, describe(record.kind), removed_by_retention=record.removed_events,
                        removed_through=record.removed_through)
        read = _topics(conn, record, settings, topics)
        if record.kind == "kafka":
            record = dataclasses.replace(record, default_topic=settings.default_topic)
        if topics:  # only these are read back: the events of the others are not checked
            record = dataclasses.replace(record, topics=tuple(t for t in topics if record.topics is None
                                                              or t in record.topics))
        check = Check(report, read_back(record.kind, settings, read, timeout_seconds), sample=sample)
        for events in buckets(conn, record, page):
            check.add(events)
    missing = check.unmatched()
    later = [r[0] for r in conn.execute(query("verify", "stored_ids"), {"ids": missing})] if missing else []
    report = check.finish(later)
    if report.reordered and not record.commit_times:
        report.notes.append("two transactions of one key that overlapped may come in either order (docs/guarantees.md);"
                            " the server records no commit times (track_commit_timestamp = off), so every inversion "
                            "is counted: turn it on to tell those apart")
    return report


def _topics(conn: psycopg.Connection[Any], record: SinkRecord, settings: RelaySettings,
            topics: Sequence[str] | None) -> list[str]:
    if record.kind == "projection":
        return []
    if record.kind == "kafka" and settings.kafka_format == "debezium" and settings.kafka_debezium_route_by == "type":
        raise ConfigurationError("verify reads a Debezium-format sink routed by topic only "
                                 "(--kafka-debezium-route-by type is not supported yet)")
    if topics:
        return [t for t in topics if record.topics is None or t in record.topics]
    found = list(record.topics) if record.topics is not None else stored_topics(conn)
    if record.kind == "kafka" and settings.default_topic and settings.default_topic not in found:
        found.append(settings.default_topic)  # events without a topic of their own go there
    return found
