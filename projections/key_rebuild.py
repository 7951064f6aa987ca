"""``rebuild_key``: one partition key's state rebuilt in place, atomically: in one transaction, holding
the key's bucket cursor, clear its state (the projection's ``key_reset``) and replay the key's events
that live processing applied. The transaction itself is key_replay.py's (generated from
key_replay_async.py), over the parts in key_replay_parts.py.
"""

from __future__ import annotations

import asyncio

import psycopg

from outbox_relay.errors import ConfigurationError

from .declare import Projection
from .history_gap import history_gap
from .key_replay import replay_key
from .key_replay_async import areplay_key
from .rebuild_error import RebuildError


def rebuild_key(projection: Projection, dsn: str, key: str, tries: int = 3, *, accept_partial: bool = False) -> int:
    """Rebuild one partition key's state in place, atomically; returns the events replayed.

    Under the same commit guard as a projection batch (see sink.py): a handler (or key_reset) that
    ends the transaction makes the whole key rebuild fail, never half of it commit. Refuses when
    retention removed events the projection applied, unless ``accept_partial``."""
    if projection.clear_key is None:
        raise ConfigurationError(f"projection {projection.name!r} has no key_reset: declare one with "
                                 f"@{projection.handler.__name__}.key_reset to rebuild a single key")
    if not accept_partial:
        with psycopg.connect(dsn, autocommit=True) as conn:
            gap = history_gap(conn, projection.name, projection.topics)
        if gap is not None:
            raise RebuildError(
                f"rebuilding key {key!r} of {projection.name!r} would be partial: {gap.describe()}. Nothing was "
                "changed; pass --accept-partial to rebuild the key from the events still stored")
    for attempt in range(1, tries + 1):
        try:
            if projection.is_async:
                return asyncio.run(areplay_key(projection, dsn, key))
            return replay_key(projection, dsn, key)
        except psycopg.errors.DeadlockDetected:  # a live batch of the same bucket: it retries, so do we
            if attempt == tries:
                raise
    raise AssertionError("unreachable")
