"""What live processing decided about events a rebuild replays (G12).

A rebuild replays history into fresh tables; the live projection's dead letters (events past their
attempts, events an operator skipped with ``keys skip``, events that could not be applied) are
decisions the replay must follow, or the new model would hold effects the live one never had and
the swap would forget the operator's skip. So every batch of a rebuild (a relay-phase batch,
sink.py, and a bulk-phase slice, bulk.py) looks up, in its own transaction, which of its events are
dead-lettered for the live projection; the walk (walk.py ``Batch.decided``) records those as dead
with the live reason without calling the handler, and the key moves on as it did live. The switch
(rebuild.py) then keeps the live dead letter rows as they were.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from outbox_relay.sink import AsyncConn, Failure
from outbox_relay.sqlfiles import query
from outbox_relay.store import Conn

# The parked rows of a rebuild that hold an event because the live projection has it parked; the switch
# tells them apart by this error (rebuild.sql: follow_live, keep_live_decisions).
HELD = "held: the live projection has this event parked (a retry, queued behind one, or its key paused)"
HOLD_SECONDS = 1.0  # how often a hold looks again whether live processing applied the event


def _params(live: str, ids: Sequence[uuid.UUID]) -> dict[str, Any]:
    return {"live": live, "ids": list(ids)}


def _decided(rows: Sequence[Sequence[Any]]) -> dict[Any, Failure]:
    """Dead live: dead here, with the live reason. Parked live: held here, no attempt counted."""
    return {event: Failure(HELD, hold_seconds=HOLD_SECONDS) if held else Failure(str(error), retriable=False)
            for event, error, held in rows}


def live_decisions(conn: Conn, live: str, ids: Sequence[uuid.UUID]) -> dict[Any, Failure]:
    """What the live projection ``live`` decided about the events of ``ids``, as the walk's decided failures."""
    if not ids:
        return {}
    return _decided(conn.execute(query("rebuild", "live_decisions"), _params(live, ids)).fetchall())


async def alive_decisions(conn: AsyncConn, live: str, ids: Sequence[uuid.UUID]) -> dict[Any, Failure]:
    """``live_decisions`` on an async connection."""
    if not ids:
        return {}
    cur = await conn.execute(query("rebuild", "live_decisions"), _params(live, ids))
    return _decided(await cur.fetchall())
