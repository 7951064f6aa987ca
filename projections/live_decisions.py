# WARNING: generated from projections/live_decisions_async.py by scripts/async_to_sync.py: edit the source, then run
# `python scripts/async_to_sync.py --write`.
"""What the live projection decided about a batch a rebuild replays, looked up in the batch's own transaction
(decisions.py says why a rebuild follows those decisions, and turns the rows into the walk's failures): a
relay-phase batch (sink.py) and a bulk-phase slice (bulk.py) ask it. This is live_decisions_async.py, the
one source: live_decisions.py is generated from it (scripts/async_to_sync.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from outbox_relay.sinks.engine import Failure
from outbox_relay.sqlfiles import query

from .decisions import decided_failures, decision_range
from .walk import Delivered


def live_decisions(conn: psycopg.Connection[Any], live: str,
                   events: Sequence[Delivered]) -> dict[Any, Failure]:
    """What the live projection ``live`` decided about ``events``, as the walk's decided failures."""
    if not events:
        return {}
    cur = conn.execute(query("rebuild", "live_decisions"), decision_range(live, events))
    return decided_failures(cur.fetchall(), events)
