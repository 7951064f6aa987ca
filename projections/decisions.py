"""What live processing decided about events a rebuild replays (G12).

A rebuild replays history into fresh tables; the live projection's dead letters (events past their
attempts, events an operator skipped with ``keys skip``, events that could not be applied) are
decisions the replay must follow, or the new model would hold effects the live one never had and
the swap would forget the operator's skip. So every batch of a rebuild (a relay-phase batch,
sink.py, and a bulk-phase slice, bulk.py) looks up, in its own transaction, which of its events are
dead-lettered for the live projection (live_decisions_async.py, and the live_decisions.py generated
from it); the walk (walk.py ``Batch.decided``) records those as dead with the live reason without
calling the handler, and the key moves on as it did live. The switch (rebuild_switch.py) then keeps
the live dead letter rows as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from outbox_relay.sinks.engine import Failure
from outbox_relay.sqlfiles import query
from outbox_relay.store import Conn, StoredEvent

from .walk import Delivered

# The parked rows of a rebuild that hold an event because the live projection has it parked; the switch
# tells them apart by this error (rebuild.sql: follow_live, keep_live_decisions).
HELD = "held: the live projection has this event parked (a retry, queued behind one, or its key paused)"
HOLD_SECONDS = 1.0  # how often a hold looks again whether live processing applied the event


def decision_range(live: str, events: Sequence[Delivered]) -> dict[str, Any]:
    """The batch's transaction id range: decisions are looked up by position (two index range scans), not per
    event, so a batch costs the same whatever its size and nothing when live processing decided nothing."""
    xids = [e.xid if isinstance(e, StoredEvent) else e.position[0] for e in events]
    return {"live": live, "lo": min(xids), "hi": max(xids)}


def decided_failures(rows: Sequence[Sequence[Any]], events: Sequence[Delivered]) -> dict[Any, Failure]:
    """Dead live: dead here, with the live reason. Parked live: held here, no attempt counted. (The range
    also returns other buckets' events of those transactions: only the batch's are kept.)"""
    if not rows:
        return {}
    ids = {e.id for e in events}
    return {event: Failure(HELD, hold_seconds=HOLD_SECONDS) if held else Failure(str(error), retriable=False)
            for event, error, held in rows if event in ids}


# -- the switch (rebuild_switch.py) ------------------------------------------------------------------


def follow_live(conn: Conn, live: str, rebuild: str) -> int:
    """Make due the rebuild's parked events whose live decision changed (dead-lettered live since, or held
    for a live retry that landed: the relay phase's retry follows); how many buckets had one. On a
    connection of its own, not the switch's: the relay phase must be able to retry them."""
    return len(conn.execute(query("rebuild", "follow_live"), {"live": live, "rebuild": rebuild, "held": HELD})
               .fetchall())


def keep_live_decisions(conn: Conn, live: str, rebuild: str) -> list[str]:
    """In the switch's transaction: keep live rows where both sinks decided, drop the live rows of events the
    rebuild applied (decided live after it had passed them). Returns what it dropped, as sentences."""
    rows = conn.execute(query("rebuild", "keep_live_decisions"), {"live": live, "rebuild": rebuild, "held": HELD})
    return [_dropped(*r) for r in rows.fetchall()]


def _dropped(kind: str, event_id: Any, key: str, error: str | None) -> str:
    if kind == "dead":
        return (f"event {event_id} of key {key!r} was dead-lettered for the live projection ({error}) after the "
                "rebuild had applied it: the new model holds its effect, so its dead letter is dropped")
    return (f"event {event_id} of key {key!r} was parked for the live projection ({error or 'queued'}) but the "
            "rebuild applied it: the new model holds its effect, so its live retry is dropped")


@dataclass(frozen=True)
class WaitingKey:
    """A key whose events wait in the projection's park after the switch."""

    key: str
    head: Any  # the event id at the head of its queue
    attempts: int
    last_error: str | None
    parked: int  # its events in the park, the head included
    paused: bool  # held by an operator (keys pause), not failing

    def describe(self) -> str:
        why = "paused" if self.paused else f"retrying after {self.attempts} attempts: {self.last_error or 'queued'}"
        return f"key {self.key!r}: {self.parked} events wait behind {self.head} ({why})"


def waiting_keys(conn: Conn, live: str) -> list[WaitingKey]:
    """After the swap, in its transaction: the keys whose events wait in the projection's park."""
    return [WaitingKey(*r) for r in conn.execute(query("rebuild", "waiting_keys"), {"live": live})]
