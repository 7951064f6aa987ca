"""Sinks as operators see them: list, drop (a tombstone), recreate; and the check that a sink is live."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from ..errors import OutboxError
from .table import DEFAULT_WORKER_TTL_SECONDS, Conn, Table, fetch_table


@dataclass(frozen=True)
class SinkDrop:
    """What ``drop_sink`` did. ``dropped`` False: the sink was already dropped, at ``dropped_at``.
    ``in_use``: who still used it (only with force); ``abandoned_rebuild_of``: the projection whose
    rebuild the sink belonged to, its copies kept in schema ``retired_schema``."""

    sink: str
    kind: str
    dropped: bool
    dropped_at: datetime | None = None
    pending_lost: int = 0
    parked_deleted: int = 0
    dead_letters_deleted: int = 0
    in_use: tuple[str, ...] = ()
    abandoned_rebuild_of: str | None = None
    retired_schema: str | None = None


@dataclass(frozen=True)
class SinkRecreated:
    sink: str
    kind: str


def no_such_sink(conn: Conn, name: str) -> OutboxError:
    """The error for a sink name that is not live: dropped (and when), or never registered."""
    found = fetch_table(conn, "sink", {"sink": name}).rows
    if found and found[0][1] is not None:
        return OutboxError(f"sink {name!r} was dropped at {found[0][1]:%Y-%m-%d %H:%M:%S%z}")
    return OutboxError(f"no sink named {name!r}")


def live_sink(conn: Conn, name: str) -> None:
    """Refuse a sink that does not exist or was dropped; lock a live one against a drop until the
    transaction ends."""
    found = fetch_table(conn, "share_sink", {"sink": name}).rows
    if not found or found[0][1] is not None:
        raise no_such_sink(conn, name)


def sinks(conn: Conn) -> Table:
    """Every sink: kind, when created, whether (and when) dropped."""
    return fetch_table(conn, "sinks")


def drop_sink(conn: Conn, name: str, *, force: bool = False,
              worker_ttl_seconds: float = DEFAULT_WORKER_TTL_SECONDS) -> SinkDrop:
    """Tombstone a sink: its cursors, parked events and dead letters are deleted and relays stop
    running it. Refused (OutboxError) while a relay heard from within ``worker_ttl_seconds`` runs it,
    holds a lease on it, or a rebuild would switch over into it; ``force`` drops it anyway. One
    transaction: the sink's row and cursors are locked before its users are looked for, so none can
    appear unseen. Dropping a dropped sink changes nothing (``dropped`` False)."""
    params = {"sink": name, "ttl": worker_ttl_seconds}
    with conn.transaction():
        # Counted before the locks: with a large backlog the count takes a while, and relays renewing
        # leases on this sink would wait for it.
        pending, parked, dead = fetch_table(conn, "sink_losses", params).rows[0]
        found = fetch_table(conn, "lock_sink", params).rows
        if not found:
            raise OutboxError(f"no sink named {name!r}")
        kind, dropped_at = found[0]
        if dropped_at is not None:
            return SinkDrop(sink=name, kind=kind, dropped=False, dropped_at=dropped_at)
        fetch_table(conn, "lock_sink_cursors", params)
        users = [f"relay {w} ({state}, heard from {seen}s ago) runs it"
                 for w, state, seen in fetch_table(conn, "sink_workers", params).rows]
        users += [f"{n} bucket(s) leased by {owner}" for owner, n in fetch_table(conn, "sink_leases", params).rows]
        users += [f"a rebuild of it (sink {sink!r}, started {started:%Y-%m-%d %H:%M}) is in progress and would "
                  f"switch over into it: `outbox-relay rebuild {name} --cancel` first"
                  for sink, started in fetch_table(conn, "sink_rebuild", params).rows]
        if users and not force:
            cost = (f"{pending} pending event(s) never reach it, {parked} parked event(s) and {dead} dead letter(s) "
                    "are deleted")
            raise OutboxError(f"sink {name!r} is in use: " + "; ".join(users) + ". Stop those relays (or take the "
                              "sink out of their configuration) and run this again, or pass --force: "
                              f"{cost}, and a relay still running it stops")
        _, parked, dead, rebuild_of, shadow = fetch_table(conn, "drop_sink", params).rows[0]
    return SinkDrop(sink=name, kind=kind, dropped=True, pending_lost=pending, parked_deleted=parked,
                    dead_letters_deleted=dead, in_use=tuple(users), abandoned_rebuild_of=rebuild_of,
                    retired_schema=shadow)


def recreate_sink(conn: Conn, name: str) -> SinkRecreated:
    """Let relays register a dropped sink again (it starts from the oldest retained event)."""
    with conn.transaction():
        found = fetch_table(conn, "lock_sink", {"sink": name}).rows
        if not found:
            raise OutboxError(f"no sink named {name!r}")
        if found[0][1] is None:
            raise OutboxError(f"sink {name!r} is not dropped: nothing to recreate")
        fetch_table(conn, "recreate_sink", {"sink": name})
    return SinkRecreated(sink=name, kind=found[0][0])
