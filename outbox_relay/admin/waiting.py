"""The keys of one sink that wait, a page at a time, each with why in the words of ``keys show``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError
from .keys import KeyDeadLetters, KeyHead, KeyPause, key_summary, lease_holder
from .sink_lifecycle import live_sink
from .table import DEFAULT_MAX_ATTEMPTS, Conn, Table, fetch_table

WAITING_KEYS_LIMIT = (1, 500)  # one page of waiting_keys
PAUSED_KEYS_SHOWN = 200


@dataclass(frozen=True)
class WaitingKey:
    """A key of the sink with a parked head: ``state`` and ``summary`` as ``keys show`` says them (the
    events of the key not read yet are not counted here: that is a scan of its bucket)."""

    key: str
    bucket: int
    head: KeyHead
    parked: int
    owner: str | None
    dead_letters: int
    paused: KeyPause | None
    state: str
    summary: str


@dataclass(frozen=True)
class WaitingPage:
    """``keys`` in (bucket, key) order; ``more``: ask for the next page with ``after=page.last``."""

    sink: str
    keys: list[WaitingKey]
    more: bool

    @property
    def last(self) -> tuple[int, str] | None:
        return (self.keys[-1].bucket, self.keys[-1].key) if self.keys else None


def waiting_keys(conn: Conn, sink: str, *, limit: int = 50, after: tuple[int, str] | None = None,
                 max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> WaitingPage:
    """One page of ``sink``'s keys with a parked head (retrying, due, paused with events held), after the
    (bucket, key) ``after``. OutboxError if the sink is not live."""
    low, high = WAITING_KEYS_LIMIT
    if not low <= limit <= high:
        raise ConfigurationError(f"a page of waiting keys holds {low}-{high}, not {limit}")
    with conn.transaction():
        live_sink(conn, sink)
        bucket, key = after if after is not None else (None, None)
        rows = fetch_table(conn, "waiting_keys", {"sink": sink, "after_bucket": bucket, "after_key": key,
                                                  "limit": limit + 1}, group="console").records()
    keys = [_waiting(r, max_attempts) for r in rows[:limit]]
    return WaitingPage(sink=sink, keys=keys, more=len(rows) > limit)


def _waiting(r: dict[str, Any], max_attempts: int) -> WaitingKey:
    head, paused, owner = KeyHead.of_row(r), KeyPause.of_row(r), lease_holder(r)
    recent = [{"last_error": r["last_dead_error"]}] if r["dead_letters"] else []
    dead = KeyDeadLetters(count=r["dead_letters"], last_at=r["last_dead_at"], recent=recent)
    state, summary = key_summary(head, paused, owner, r["bucket"], max(0, r["parked"] - 1), r["parked"], None,
                                 1, dead, max_attempts)
    return WaitingKey(key=r["partition_key"], bucket=r["bucket"], head=head, parked=r["parked"], owner=owner,
                      dead_letters=r["dead_letters"], paused=paused, state=state, summary=summary)


def paused_keys(conn: Conn, sink: str, *, limit: int = PAUSED_KEYS_SHOWN) -> Table:
    """The sink's paused keys, the oldest pause first (at most ``limit``)."""
    return fetch_table(conn, "paused_keys", {"sink": sink, "limit": limit}, group="console")
