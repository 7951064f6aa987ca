"""Pure rules over one batch's outcomes: the checkpoint that keeps per-key order, and whether a failed
batch may be an event's doing."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
from psycopg_pool import PoolTimeout

from ..backoff import Backoff
from ..errors import CheckpointFailed, LeaseLost, SinkDropped, SinkStuck
from ..sinks.engine import Failure, KeyHold, Outcomes
from ..store import Checkpoint, StoredEvent

CRASH_ERROR = ("the relay stopped while delivering this event alone (process crash, kill, or stall past the "
               "lease); counted as a failed attempt")
# A timeout that cut a batch short can be an event's doing (a handler slower than the lease).
_EVENT_TIMEOUTS = {"57014", "25P03", "25P04"}  # query_canceled, idle_in_transaction / transaction timeout
# Classes of server errors that say nothing about the events: connection, resources, operator
# intervention (shutdown, terminated backend), system errors.
_INFRASTRUCTURE_CLASSES = {"08", "53", "57", "58"}
_UNTRIED = Failure("not attempted")  # classify: an event the sink did not attempt (no outcome)


def points_at_events(exc: BaseException) -> bool:
    """Whether a batch that raised ``exc`` may have failed because of one of its events (so that
    retrying its events one at a time can find the culprit), rather than because the database or the
    relay's own bookkeeping failed."""
    if isinstance(exc, CheckpointFailed | PoolTimeout | LeaseLost | SinkDropped | SinkStuck):
        return False
    if isinstance(exc, psycopg.Error):
        if exc.sqlstate in _EVENT_TIMEOUTS:
            return True
        if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
            return False
        if exc.sqlstate and exc.sqlstate[:2] in _INFRASTRUCTURE_CLASSES:
            return False
    return True


def classify(events: Sequence[StoredEvent], outcomes: Outcomes, fences: dict[int, int], *,
             max_attempts: int, backoff: Backoff) -> Checkpoint:
    """Turn per-event outcomes into a checkpoint that keeps per-key order.

    Walks each key in position order: delivered events are done; the first failure parks the
    key (or dead-letters the event if it can never succeed or has no attempts left, which
    unblocks the key; a failure the sink holds, ``Failure.hold_seconds``, parks it without
    counting an attempt); everything behind a parked head is parked behind it. Events read from
    the park stay there unless delivered or dead-lettered.
    """
    cp = Checkpoint(fences=fences)
    hold = KeyHold()  # keys whose head is parked in this batch (the sink followed the same rule)
    for e in events:
        outcome = outcomes.get(e.id, _UNTRIED)  # one lookup: a uuid's hash is a Python call
        if e.blocked or not hold.allows(e) or outcome is _UNTRIED:
            hold.hold(e.key)
            if not e.parked:
                cp.park.append((e, e.attempts, 0.0, None))
            continue
        if outcome is None:
            cp.delivered.append(e)
            if e.parked:
                cp.done.append(e)
            continue
        if outcome.hold_seconds is not None:  # the sink's condition, not the event's: no attempt counted
            cp.park.append((e, e.attempts, outcome.hold_seconds, outcome.error))
            hold.hold(e.key)
            continue
        attempts = e.attempts + 1
        if not outcome.retriable or attempts >= max_attempts:
            cp.dead.append((e, attempts, outcome.error))
            if e.parked:
                cp.done.append(e)
        else:
            delay = backoff.delay(attempts)
            if outcome.retry_after is not None:
                delay = max(delay, outcome.retry_after)
            cp.park.append((e, attempts, delay, outcome.error))
            hold.hold(e.key)
    return cp
