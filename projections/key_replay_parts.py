"""What a key rebuild's transaction (key_replay.py, key_replay_async.py) needs besides I/O: its batch
of the shared walk, how its failures end it, its parameters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg

from outbox_relay.store import StoredEvent

from .declare import Projection
from .rebuild_error import RebuildError
from .walk import ENDED_STATES, ENDED_TRANSACTION, Batch, Redo

# A stalled key rebuild must not hold its bucket's cursor (the live relay's checkpoint) for long.
KEY_REBUILD_IDLE_MS = "30000"


def key_begin(token: str) -> dict[str, Any]:
    return {"token": token, "idle_ms": KEY_REBUILD_IDLE_MS, "shadow": None}


def key_batch(projection: Projection, key: str, cursor: Sequence[Any], events: Sequence[StoredEvent],
               token: str) -> Batch:
    """The key's history as one batch of the shared walk (walk.py), begun by the caller.

    Its tokens are (live fence, 0, xid, seq): increasing in the (xid, seq) order they are applied
    in, and below every token the live owner of that fence gave (its reads are numbered from 1), so
    a store outside the transaction (``fenced_upsert``) keeps what live processing wrote there."""
    fence = int(cursor[2])
    return Batch(projection, events, {e.bucket: fence for e in events}, replay=True, name=projection.name,
                 token=token)


@contextlib.contextmanager
def key_failures(projection: Projection, key: str) -> Iterator[None]:
    """A key rebuild is all or nothing: what would make the walk redo a batch fails it instead."""
    try:
        yield
    except Redo as redo:
        if redo.ended is not None or any(f is ENDED_TRANSACTION for f in redo.failed.values()):
            raise RebuildError(f"rebuilding key {key!r} of {projection.name!r}: its handler or key_reset ended the "
                               "transaction (COMMIT, END or ROLLBACK); nothing was changed") from redo
        if isinstance(redo.__cause__, Exception):
            raise redo.__cause__ from None  # the handler's own error, as it raised it
        raise RebuildError(f"rebuilding key {key!r} of {projection.name!r}: a statement of its handler failed "
                           "(or the handler ended the transaction); nothing was changed") from redo
    except psycopg.Error as exc:
        if exc.sqlstate in ENDED_STATES:
            raise RebuildError(f"rebuilding key {key!r} of {projection.name!r}: its handler or key_reset ended the "
                               "transaction (COMMIT, END or ROLLBACK); nothing was changed") from exc
        raise


def key_params(projection: Projection, key: str, cursor: Sequence[Any]) -> dict[str, Any]:
    return {"sink": projection.name, "key": key, "seen": cursor[0], "target": cursor[1], "after_xid": cursor[3],
            "after_seq": cursor[4],
            **projection.event_filter.params()}


def replayed(projection: Projection, key: str, batch: Batch) -> int:
    """The events the key rebuild replayed; an event that no longer applies fails it (rolled back)."""
    for e in batch.events:
        outcome = batch.outcomes.get(e.id)
        if outcome is not None:
            raise RebuildError(f"event {e.id} of key {e.key!r} no longer applies: {outcome.error}")
    return len(batch.events)
