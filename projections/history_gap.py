"""What retention removed from a projection's history since it began (``history_gap``): a rebuild of it,
or of one key, would be partial."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from outbox_relay.sqlfiles import query


@dataclass(frozen=True)
class HistoryGap:
    """What retention removed, after a projection's history began, of partitions that held its topics."""

    through: datetime  # the newest removed event (created_at)
    removed_xid: int  # the largest removed transaction id
    removed: int  # events removed from those partitions in all (of the topics it reads, or others they held)
    parts: tuple[str, ...]  # per retention class: which topics, how many, up to when
    oldest: datetime | None  # the oldest event of its topics still stored
    topics: tuple[str, ...] | None

    def describe(self) -> str:
        which = "its topics " + ", ".join(self.topics) if self.topics is not None else "every topic"
        return (f"retention has removed {self.removed:,} events stored up to {self.through.isoformat()} from "
                f"partitions that held events of {which} ({'; '.join(self.parts)}), after the projection had applied "
                f"them; history now exists from {self.oldest.isoformat() if self.oldest else 'no event at all'} on")


def history_gap(conn: psycopg.Connection[Any], sink: str, topics: Sequence[str] | None = None) -> HistoryGap | None:
    """What retention removed since ``sink``'s history began from partitions that held events of
    ``topics`` (None: every topic), per retention class; None if nothing is missing."""
    reads = sorted(set(topics)) if topics is not None else None
    rows = conn.execute(query("rebuild", "history_gap"), {"sink": sink, "topics": reads}).fetchall()
    if not rows:
        return None
    parts = []
    for cls, held, but, through, _, removed in rows:
        what = ("every topic" if cls == "(all)" else f"topics {', '.join(held)}" if held is not None
                else "every topic" + (f" but {', '.join(but)}" if but else ""))
        where = "events_legacy or events_default" if cls == "(all)" else f"class {cls}"
        parts.append(f"{where} ({what}): {removed:,} events up to {through.isoformat()}")
    oldest = conn.execute(query("rebuild", "stored_from"), {"topics": reads}).fetchone()
    return HistoryGap(through=max(r[3] for r in rows), removed_xid=max(int(r[4]) for r in rows),
                      removed=sum(int(r[5]) for r in rows), parts=tuple(parts), oldest=oldest[0] if oldest else None,
                      topics=tuple(reads) if reads is not None else None)
