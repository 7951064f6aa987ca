"""``outbox-relay status`` as one call: relays, backlog, horizon, dead letters by key, rebuilds, history."""

from __future__ import annotations

from dataclasses import dataclass

from .table import DEFAULT_RETENTION_SECONDS, Conn, Table, fetch_history, fetch_table


@dataclass(frozen=True)
class Status:
    """What ``outbox-relay status`` shows: relays and their buckets, the backlog per sink, the oldest open
    writing transaction, dead letters by key, rebuilds in progress, history per retention class and each
    projection's history."""

    workers: Table
    backlog: Table
    oldest_open_transaction: Table
    dead_letters_by_key: Table
    rebuilds: Table
    retention: Table
    history: Table


def status(conn: Conn, *, all_databases: bool = False, dead_letter_keys: int = 20,
           retention_seconds: float = DEFAULT_RETENTION_SECONDS) -> Status:
    """Relays, backlog, the oldest open writing transaction (of the outbox's database; of the whole
    server with ``all_databases``), the ``dead_letter_keys`` keys with most dead letters, rebuilds,
    history per retention class (``retention_seconds``: the relays' --retention-seconds, what the
    default class keeps unless set) and history per projection."""
    return Status(
        workers=fetch_table(conn, "workers"),
        backlog=fetch_table(conn, "backlog", {"sink": None}),
        oldest_open_transaction=fetch_table(conn, "horizon_holder", {"all_databases": all_databases}),
        dead_letters_by_key=fetch_table(conn, "dead_letters_by_key", {"sink": None, "limit": dead_letter_keys}),
        rebuilds=fetch_table(conn, "rebuilds"),
        retention=fetch_history(conn, "by_class", retention_seconds),
        history=fetch_table(conn, "history"),
    )


def relays(conn: Conn) -> Table:
    """The relay registry (what ``status`` shows first): status, sinks, when each was last heard from and
    the TTL it is judged by, host and pid, whether it listens, its leased buckets per sink."""
    return fetch_table(conn, "workers")


def rebuilds(conn: Conn) -> Table:
    """Projection rebuilds in progress: started when, how many events they replay (total_events)."""
    return fetch_table(conn, "rebuilds")


def projection_history(conn: Conn) -> Table:
    """Per projection: from when its topics are stored, what retention removed, whether a full rebuild holds
    everything it applied."""
    return fetch_table(conn, "history")
