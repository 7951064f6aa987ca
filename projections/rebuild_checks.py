"""What a rebuild (rebuild.py) refuses before it changes anything: a start past stored history, and
history that retention removed part of (a rebuild is never silently partial)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from outbox_relay.sqlfiles import query

from .declare import Projection
from .history_gap import history_gap
from .rebuild_error import RebuildError


def check_start(conn: psycopg.Connection[Any], from_position: tuple[int, int] | None,
                from_time: datetime | None) -> None:
    """Refuse a start past stored history before anything is created: from there the rebuild would
    replay nothing, swap in an empty model and park the live projection's cursors there (past every
    transaction id there is, for good if far enough). Refuse a start from history that retention
    has removed part of is refused later, once the rebuild holds retention back (``Rebuild._check_retained``)."""
    if from_position is None and from_time is None:
        return
    row = conn.execute(query("rebuild", "history_bounds")).fetchone()
    assert row is not None
    next_xid, first, last, newest, now = row
    stored = (f"the stored events span positions {first[0]}:{first[1]} to {last[0]}:{last[1]}" if last
              else "no event is stored")
    context = f"(the next transaction id is {next_xid}; {stored})"
    if from_position is not None:
        xid, seq = from_position
        if last is None or (xid, seq) > (last[0], last[1]):
            past = "past every transaction id there is" if xid >= next_xid else "after the last stored event"
            raise RebuildError(
                f"--from-position {xid}:{seq} is {past} {context}: a rebuild from there replays nothing and "
                "swaps in an empty model; nothing was changed. Give a position of the stored history (an "
                "event's ce_sequence)")
        return
    assert from_time is not None
    if from_time > now:
        raise RebuildError(f"--from-time {from_time.isoformat()} is in the future (the database's time is "
                           f"{now.isoformat()}); nothing was changed")
    if newest is None or from_time > newest:
        raise RebuildError(
            f"--from-time {from_time.isoformat()}: no event was stored at or after it (the newest "
            f"was stored {newest.isoformat() if newest else 'never'}): a rebuild from there replays nothing "
            "and swaps in an empty model; nothing was changed")


def check_history(conn: psycopg.Connection[Any], projection: Projection, live_sink: str,
                  from_position: tuple[int, int] | None, from_time: datetime | None) -> None:
    """A rebuild is never silently partial: refuse when retention removed events its projection
    applied (since the live model's history began, from partitions that held the topics it reads), or
    events at or after --from-time/--from-position."""
    gap = history_gap(conn, live_sink, projection.topics)
    if gap is None:
        return
    if from_time is not None and from_time > gap.through:
        return
    if from_position is not None and from_position[0] > gap.removed_xid:
        return
    start = (f"--from-time {from_time.isoformat()}" if from_time else
             f"--from-position {from_position[0]}:{from_position[1]}" if from_position else
             "the beginning")
    raise RebuildError(
        f"rebuild of {projection.name!r} from {start} would be partial: {gap.describe()}. Nothing was "
        "changed. Keep that history longer (outbox-relay retention class), or pass --accept-partial to build the "
        "model from the events still stored")


def history_unchecked(conn: psycopg.Connection[Any], projection: Projection) -> bool:
    """A resumed rebuild that never got past its history check (it counts its events after it)."""
    row = conn.execute(query("rebuild", "get"), {"projection": projection.name}).fetchone()
    return row is not None and row[5] is None
