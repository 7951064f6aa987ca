"""Re-publish stored events to Kafka: a topic's events in a time range, or one key's.

Not a sink: a replay has no cursors or leases and does not touch the live Kafka sink's
progress. It reads each bucket's events in (xid, seq) order (per key the live order, except for
two overlapping transactions of one key: docs/design-read-path.md, "What order one key gets"), only
those of transactions that had ended when it started (``horizon`` in sql/queries/replay.sql: its
own stopping point, below the oldest transaction open then), and produces them with the live
headers plus ``outbox_replay: true`` (consumers that keep state can tell), to their own topic or to
``to_topic``. Kafka ordering holds per key as for live delivery; a replayed event may of
course arrive after later live events of its key.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TextIO

import psycopg

from .assignment import BUCKETS
from .migrate import check_schema
from .progress_line import ProgressLine
from .settings import RelaySettings
from .sinks.engine import CommitAtEnd, Outcomes
from .sinks.kafka import KafkaSink
from .sqlfiles import query
from .store import Conn, StoredEvent, event_reader
from .upcast import UpcastError, Upcasters

REPLAY_HEADER = ("outbox_replay", b"true")


@dataclass
class ReplayResult:
    sent: int = 0
    failed: list[tuple[uuid.UUID, str]] = field(default_factory=list)  # event id, why


class _Collect(CommitAtEnd):
    """The ``sink.Commit`` of a replay: nothing to checkpoint, only outcomes to count."""

    def __init__(self) -> None:
        self.outcomes: Outcomes = {}

    def __call__(self, outcomes: Outcomes, tx: Conn | None) -> set[int]:
        self.outcomes = outcomes
        return set()


def replay(settings: RelaySettings, topic: str, *, from_time: datetime | None = None,
           to_time: datetime | None = None, key: str | None = None, to_topic: str | None = None,
           progress: TextIO | None = sys.stderr, abort: threading.Event | None = None,
           upcasters: Upcasters | None = None) -> ReplayResult:
    """Produce the stored events of ``topic`` (``default_topic`` for events stored without one)
    created in [from_time, to_time), or only ``key``'s, to ``to_topic`` or their own topic; with
    ``upcasters``, each payload in its type's current shape (an event no step can bring there is
    not sent and is named in the result)."""
    abort = abort or threading.Event()
    sink = KafkaSink("replay", settings.kafka_producer_config(), settings.default_topic, settings.source,
                     settings.kafka_stall_seconds, topic=to_topic, extra_headers=[REPLAY_HEADER])
    result = ReplayResult()
    try:
        with psycopg.connect(settings.dsn.get_secret_value(), autocommit=True) as conn:
            check_schema(conn)
            # A replay reads few, large pages: planning each costs nothing next to them, and a custom plan
            # sees the real key and time range.
            conn.execute("SET plan_cache_mode = force_custom_plan")
            filters: dict[str, Any] = {
                "topic": topic, "default_topic": settings.default_topic, "from_time": from_time,
                "to_time": to_time, "key": key, "until": _one(conn, "horizon", {})}
            buckets = [_one(conn, "bucket_of", {"key": key})] if key is not None else list(range(BUCKETS))
            line = ProgressLine(progress, f"replay {topic}" + (f" key {key!r}" if key else ""),
                                _one(conn, "count", {**filters, "buckets": buckets}))
            positions = {b: (0, 0) for b in buckets}
            limit = max(8, settings.batch_size // len(buckets))
            while positions:
                page = _page(conn, filters, positions, limit)
                if not page:
                    break
                events = page
                if upcasters is not None:
                    events = []
                    for e in page:
                        try:
                            events.append(_upcast(e, upcasters))
                        except UpcastError as exc:
                            result.failed.append((e.id, str(exc)))
                collect = _Collect()
                sink.deliver(events, {e.bucket: 0 for e in events}, collect, abort)
                for e in events:
                    outcome = collect.outcomes.get(e.id, "not sent: an earlier event of its key failed")
                    if outcome is None:
                        result.sent += 1
                    else:
                        result.failed.append((e.id, outcome if isinstance(outcome, str) else outcome.error))
                got: dict[int, int] = {}
                for e in page:
                    positions[e.bucket] = e.position
                    got[e.bucket] = got.get(e.bucket, 0) + 1
                positions = {b: p for b, p in positions.items() if got.get(b, 0) >= limit}  # the rest are done
                line.update(result.sent + len(result.failed))
            line.finish(f"{result.sent:,} events sent" + (f", {len(result.failed):,} failed" if result.failed
                                                          else ""))
    finally:
        sink.close()
    return result


def _upcast(e: StoredEvent, upcasters: Upcasters) -> StoredEvent:
    if upcasters.current(e.type) == e.version:
        return e
    payload, version = upcasters.upcast(e.type, e.version, json.loads(e.payload_text))
    return dataclasses.replace(e, payload_text=json.dumps(payload, separators=(",", ":"), ensure_ascii=False),
                               version=version)


def _one(conn: Conn, name: str, params: dict[str, Any]) -> Any:
    row = conn.execute(query("replay", name), params).fetchone()
    assert row is not None
    return row[0]


def _page(conn: Conn, filters: dict[str, Any], positions: dict[int, tuple[int, int]],
          limit: int) -> Sequence[StoredEvent]:
    buckets = sorted(positions)
    cur = conn.execute(query("replay", "page"), {
        **filters, "limit": limit, "buckets": buckets,
        "xids": [positions[b][0] for b in buckets], "seqs": [positions[b][1] for b in buckets]})
    event, _ = event_reader(cur)
    return [event(r) for r in cur.fetchall()]
