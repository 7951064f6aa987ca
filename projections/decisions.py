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


def _params(live: str, ids: Sequence[uuid.UUID]) -> dict[str, Any]:
    return {"live": live, "ids": list(ids)}


def _decided(rows: Sequence[Sequence[Any]]) -> dict[Any, Failure]:
    return {row[0]: Failure(str(row[1]), retriable=False) for row in rows}


def live_decisions(conn: Conn, live: str, ids: Sequence[uuid.UUID]) -> dict[Any, Failure]:
    """The events of ``ids`` that the live projection ``live`` dead-lettered, as the walk's decided failures."""
    if not ids:
        return {}
    return _decided(conn.execute(query("rebuild", "live_dead_letters"), _params(live, ids)).fetchall())


async def alive_decisions(conn: AsyncConn, live: str, ids: Sequence[uuid.UUID]) -> dict[Any, Failure]:
    """``live_decisions`` on an async connection."""
    if not ids:
        return {}
    cur = await conn.execute(query("rebuild", "live_dead_letters"), _params(live, ids))
    return _decided(await cur.fetchall())
