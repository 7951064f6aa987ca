"""Relay-side database access: every statement the relay runs, set-based per batch.

The loop (relay.py) holds no SQL; it calls these functions with a connection.
"""

from __future__ import annotations

import bisect
import functools
import json
import operator
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

# Re-exported: they were defined here, and the relay and user code import them from here.
from .checkpoint import Checkpoint as Checkpoint
from .checkpoint_writes import checkpoint as checkpoint
from .checkpoint_writes import server_started as server_started
from .checkpoint_writes_async import acheckpoint as acheckpoint
from .checkpoint_writes_async import aserver_started as aserver_started
from .errors import ConfigurationError, SinkDropped, WorkerIdInUse
from .positions import Cursor, Snapshot
from .sqlfiles import query
from .stored_event import EVENT_COLUMNS as EVENT_COLUMNS
from .stored_event import StoredEvent as StoredEvent
from .stored_event import event_reader as event_reader
from .stored_event import stored_event as stored_event

Conn = psycopg.Connection[Any]


def register_sink(conn: Conn, sink: str, kind: str, topics: Sequence[str] | None = None) -> None:
    """Create the sink and its cursors if new; refuse a name used for another kind, or dropped.
    ``topics``: the topics it reads (None: all), which tell the retention classes whose history it needs."""
    with conn.transaction():
        conn.execute(query("relay", "register_sink"), {"sink": sink, "kind": kind})
        row = conn.execute(query("relay", "lock_sink_state"), {"sink": sink}).fetchone()
        if row and row[0] != kind:
            raise ConfigurationError(f"sink {sink!r} is registered as {row[0]!r}, not {kind!r}: pick another name")
        require_live_sink(sink, row)
        conn.execute(query("relay", "set_sink_topics"),
                     {"sink": sink, "kind": kind, "topics": sorted(set(topics)) if topics is not None else None})
        conn.execute(query("relay", "register_cursors"), {"sink": sink, "kind": kind})


def sink_state(conn: Conn, sink: str) -> tuple[str, datetime | None] | None:
    """(kind, dropped_at) of a sink, None if there is no such sink."""
    row = conn.execute(query("relay", "sink_kind"), {"sink": sink}).fetchone()
    return (row[0], row[1]) if row else None


def require_live_sink(sink: str, state: Sequence[Any] | None) -> None:
    """Raise SinkDropped unless ``state`` (a sink_kind row) is a live sink."""
    if state is None:
        raise SinkDropped(f"sink {sink!r} no longer exists (dropped, or a rebuild's sink that was cancelled or "
                          "switched over)")
    if state[1] is not None:
        raise SinkDropped(
            f"sink {sink!r} was dropped at {state[1]:%Y-%m-%d %H:%M:%S %Z} (outbox-relay sinks drop); a relay does "
            "not register it again by itself, because it would start over from the oldest retained event and "
            f"apply that history a second time. To run it again on purpose: outbox-relay sinks recreate {sink}")


@dataclass(frozen=True)
class EventFilter:
    """The events a sink wants (None: all). The others are skipped in SQL, never sent to it."""

    types: tuple[str, ...] | None = None
    topics: tuple[str, ...] | None = None

    def params(self) -> dict[str, list[str] | None]:
        """The ``types`` and ``topics`` parameters of the queries that filter (NULL: no filter)."""
        return {"types": list(self.types) if self.types is not None else None,
                "topics": list(self.topics) if self.topics is not None else None}


@dataclass(frozen=True)
class Read:
    """What ``fetch_events`` returned: events per bucket in delivery order, and the snapshot it read in."""

    events: list[StoredEvent]
    now: Snapshot
    # The buckets read that were still leased to the reader under the fences it named (owner, fence, lease
    # not expired) when the read ran: the only ones it returned events of. A Kafka batch whose fence check
    # rode on the read landed in these (relay.py ``SinkRunner._pending``), at ``checked_at`` (the
    # database's clock).
    held: frozenset[int] = frozenset()
    checked_at: datetime | None = None

    def by_bucket(self) -> dict[int, list[StoredEvent]]:
        out: dict[int, list[StoredEvent]] = {}
        for e in self.events:
            out.setdefault(e.bucket, []).append(e)
        return out


# How long the starts of the xid ranges of outbox.events are reused before they are read again (read_floor).
RANGE_STARTS_SECONDS = 30.0
# Per database (host, port, name): when the starts were read, and the starts in order.
_range_starts: dict[tuple[str, str, str], tuple[float, list[int]]] = {}


def fetch_params(sink: str, worker: str, reads: dict[int, tuple[int, Cursor]], wanted: EventFilter | None = None,
                 *, formatted: bool = True, fences: dict[int, int] | None = None) -> dict[str, Any]:
    """The parameters of ``fetch_sql`` (tests and benches EXPLAIN the statement with them). ``fences``: the
    fence each bucket must still be leased under (None: any fence of the worker's unexpired lease, for
    tools and tests that read as the owner; the relay always names them)."""
    buckets = list(reads)
    cursors = [reads[b][1].params() for b in buckets]
    return {"sink": sink, "worker": worker, "buckets": buckets, "limits": [reads[b][0] for b in buckets],
            "seen": [c[0] for c in cursors], "targets": [c[1] for c in cursors],
            "after_xids": [c[2] for c in cursors], "after_seqs": [c[3] for c in cursors],
            "fences": [fences[b] for b in buckets] if fences is not None else [None] * len(buckets),
            "formatted": formatted, **(wanted or EventFilter()).params()}


def read_floor(conn: Conn, reads: dict[int, tuple[int, Cursor]]) -> int:
    """Where the xid range holding the lowest xmin of the cursors' snapshots begins: no event the read
    returns is older than that xmin."""
    return range_floor(conn, min((reads[b][1].seen.xmin for b in reads), default=0))


def range_floor(conn: Conn, xid: int) -> int:
    """Where the xid range holding ``xid`` begins (0: before every range). Starts read up to
    RANGE_STARTS_SECONDS ago can only give a lower floor (a range made since is missing: less is
    pruned), never a higher one."""
    key = (str(conn.info.host), str(conn.info.port), str(conn.info.dbname))
    now = time.monotonic()
    cached = _range_starts.get(key)
    if cached is None or now - cached[0] > RANGE_STARTS_SECONDS:
        starts = sorted(int(r[0]) for r in conn.execute(query("relay", "range_starts")) if r[0] is not None)
        cached = _range_starts[key] = (now, starts)
    i = bisect.bisect_right(cached[1], xid) - 1
    return cached[1][i] if i >= 0 else 0


def fetch_sql(conn: Conn, reads: dict[int, tuple[int, Cursor]]) -> str:
    """``fetch_events`` for these cursors, with its partition floor (``read_floor``) as a constant.

    Why: the per-bucket bounds are known only while the statement runs, so without it every plan
    covered every xid range (hundreds of partitions: tens of ms of planning and a lock per partition
    and index per read; about 1,000 ranges ran out of lock slots). A parameter prunes custom plans only,
    and Postgres still builds a generic plan over every partition once psycopg has prepared the
    statement. A constant prunes both; being a range's start, it changes once per range, so the
    prepared statement and its cached plan live on."""
    return _fetch_sql(read_floor(conn, reads))


def _fetch_sql(floor: int) -> str:
    return _with_floor("fetch_events", floor)


@functools.lru_cache(maxsize=16)
def _with_floor(name: str, floor: int) -> str:
    return sql.SQL(query("relay", name)).format(floor=sql.Literal(str(floor))).as_string(None)


def fetch_events(conn: Conn, sink: str, worker: str, reads: dict[int, tuple[int, Cursor]],
                 wanted: EventFilter | None = None, *, formatted: bool = True,
                 fences: dict[int, int] | None = None) -> Read:
    """Each bucket's delta from its cursor (positions.py), up to its limit: ``reads`` maps a bucket to
    (limit, read cursor), in the order the buckets are to be read. Buckets ``worker`` does not hold (under
    the bucket's fence in ``fences``, when given, with its lease not expired) return nothing, and are not in
    ``Read.held``. ``formatted``: with the Kafka sink's ready-made header values (``id_text``, ...)."""
    # Binary results: ids, times and numbers travel as their bytes, so that neither the server formats nor
    # the client parses text for them (the text columns are the same either way).
    cur = conn.execute(fetch_sql(conn, reads),
                       fetch_params(sink, worker, reads, wanted, formatted=formatted, fences=fences), binary=True)
    rows = cur.fetchall()
    event, column = event_reader(cur)
    last = rows[-1]  # the last row always carries the snapshot, the buckets held and the time
    # Per bucket in (xid, seq) order: the delta's delivery order (positions.py). A row without an id
    # is the one that only carries the snapshot.
    i = column["id"]
    events = sorted((event(r) for r in rows if r[i] is not None), key=_POSITION)
    return Read(events, Snapshot.parse(last[column["now"]]), frozenset(last[column["held"]] or ()),
                last[column["checked_at"]])


_POSITION = operator.attrgetter("bucket", "xid", "seq")


def fetch_parked(conn: Conn, sink: str, buckets: Sequence[int], keys: int, per_key: int, *,
                 worker: str | None = None, fences: Mapping[int, int] | None = None) -> list[StoredEvent]:
    """The due parked chains of ``buckets``. With ``worker`` (a relay), only of the buckets it still holds
    under ``fences`` (bucket -> fence), as ``fetch_events``: a relay that lost a bucket retries nothing of it."""
    if worker is not None and fences is None:
        raise ValueError("fetch_parked: a worker's read names the fence of every bucket")
    params = {"sink": sink, "buckets": list(buckets), "keys": keys, "per_key": per_key, "worker": worker,
              "fences": [fences[b] for b in buckets] if fences is not None else [None] * len(buckets)}
    floor, looked_up = _parked_floor(conn, params)
    cur = conn.execute(_with_floor("fetch_parked", floor), params)
    rows = cur.fetchall()
    event, column = event_reader(cur)
    at = column["id"]
    if not looked_up and any(r[at] is None for r in rows):
        # An event parked since the floor was looked up, older than it (an operator's retry, say): look it
        # up again and read again, so that no retry waits for the cached floor to expire.
        floor, _ = _parked_floor(conn, params, fresh=True)
        cur = conn.execute(_with_floor("fetch_parked", floor), params)
        rows = cur.fetchall()
    return [event(r, parked=True) for r in rows if r[at] is not None]


# How long the floor of the park's reads (parked_sql) is reused before the oldest parked event is looked
# up again: it was one more statement at every pass over the park.
PARKED_FLOOR_SECONDS = RANGE_STARTS_SECONDS
# Per database, sink and buckets: when the floor was looked up, and the floor.
_parked_floors: dict[tuple[str, str, str, str, tuple[int, ...]], tuple[float, int]] = {}


def parked_sql(conn: Conn, params: dict[str, Any]) -> str:
    """``fetch_parked`` with the start of the range holding the oldest parked event of these buckets
    as a constant, so that its lookup of the events plans the ranges from there on (as ``fetch_sql``).
    The floor is reused for PARKED_FLOOR_SECONDS. An event parked since may be older: ``fetch_parked``
    gets its row without the event (it is below the floor) and reads again with the floor looked up anew."""
    return _with_floor("fetch_parked", _parked_floor(conn, params)[0])


def _parked_floor(conn: Conn, params: dict[str, Any], *, fresh: bool = False) -> tuple[int, bool]:
    """The floor of ``fetch_parked`` for these parameters, and whether it was looked up by this call."""
    key = (str(conn.info.host), str(conn.info.port), str(conn.info.dbname), str(params["sink"]),
           tuple(params["buckets"]))
    now = time.monotonic()
    cached = _parked_floors.get(key)
    if not fresh and cached is not None and now - cached[0] <= PARKED_FLOOR_SECONDS:
        return cached[1], False
    oldest = conn.execute(query("relay", "oldest_parked"), params).fetchone()
    floor = range_floor(conn, int(oldest[0])) if oldest and oldest[0] else 0
    if len(_parked_floors) >= 1024:  # bucket sets come and go (leases move, a probe reads one bucket)
        _parked_floors.clear()
    _parked_floors[key] = (now, floor)
    return floor, True


def next_parked_retry(conn: Conn, sink: str, buckets: Sequence[int]) -> float | None:
    """Seconds until the next parked retry of ``buckets`` is due (<= 0: due now), None if nothing is parked."""
    row = conn.execute(query("relay", "next_parked_retry"), {"sink": sink, "buckets": list(buckets)}).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def has_parked(conn: Conn, sink: str, bucket: int) -> bool:
    row = conn.execute(query("relay", "has_parked"), {"sink": sink, "bucket": bucket}).fetchone()
    return bool(row and row[0])


# -- membership -------------------------------------------------------------------------


@dataclass(frozen=True)
class Membership:
    """A sink's stored assignment (generation 0: none yet) and its live members now."""

    sink: str
    generation: int
    members: list[str]
    owners: list[str | None]
    live: list[str]


def heartbeat(conn: Conn, worker: str, status: str, sinks: Sequence[str], metadata: dict[str, Any],
              ttl: float = 10.0, *, take_over: bool = False) -> list[Membership]:
    """Register or refresh the worker (a draining one is only refreshed, never registered again), and
    read each of its sinks' assignment and live members.

    ``metadata`` names this relay process (``instance``, ``host``, ``pid``) and the TTL it is judged by
    (``ttl_seconds``; ``ttl`` judges rows without one). WorkerIdInUse if another instance holds the id
    with a fresh heartbeat, unless ``take_over`` (a crashed run's registration: worker.py decides)."""
    rows = conn.execute(
        query("membership", "heartbeat" if status == "alive" else "heartbeat_existing"),
        {"worker": worker, "status": status, "sinks": list(sinks), "metadata": json.dumps(metadata), "ttl": ttl,
         "take_over": take_over},
    ).fetchall()
    if rows and not rows[0][5]:
        holder = rows[0][6] or {}
        pid = holder.get("pid")
        seen = float(holder.get("seen_seconds_ago") or 0.0)
        raise WorkerIdInUse(worker, holder.get("host"), int(pid) if pid and str(pid).isdigit() else None, seen,
                            float(holder.get("ttl_seconds") or ttl) - seen)
    return [Membership(r[0], r[1] or 0, list(r[2] or []), list(r[3] or []), list(r[4])) for r in rows]


def record_clash(conn: Conn, worker: str, host: str, pid: int) -> None:
    """Note on ``worker``'s registration that a relay on ``host`` (``pid``) was refused its id."""
    conn.execute(query("membership", "record_clash"), {"worker": worker, "host": host, "pid": pid})


def reassign(conn: Conn, sink: str, generation: int, members: Sequence[str], owners: Sequence[str | None]) -> bool:
    """Store a new assignment if the stored one is still ``generation``; False if another relay was first."""
    row = conn.execute(query("membership", "reassign"), {
        "sink": sink, "generation": generation, "members": list(members), "owners": list(owners)}).fetchone()
    return row is not None


def leave(conn: Conn, worker: str, instance: str | None = None) -> None:
    """Remove the worker's registration (only ``instance``'s, when given: the id may be another's now)."""
    conn.execute(query("membership", "leave"), {"worker": worker, "instance": instance})


@dataclass(frozen=True)
class Acquired:
    fence: int
    lapses: int
    cursor: Cursor


def acquire_leases(
    conn: Conn, sink: str, worker: str, buckets: Iterable[int], lease_seconds: float, restarted: Iterable[int] = ()
) -> dict[int, Acquired]:
    """The buckets this call acquired, with their fence, lapses and cursor. ``restarted``: buckets this
    process never held; one still leased in ``worker``'s name is a dead predecessor's (a lapse)."""
    rows = conn.execute(
        query("membership", "acquire_leases"),
        {"sink": sink, "worker": worker, "buckets": sorted(buckets), "lease_seconds": lease_seconds,
         "restarted": sorted(restarted)},
    ).fetchall()
    return {r[0]: Acquired(r[1], r[2], Cursor.from_row(r[3], r[4], r[5], r[6])) for r in rows}


def why_fenced(conn: Conn, sink: str, worker: str, buckets: Iterable[int]) -> dict[int, str]:
    """Of ``buckets`` lost by ``worker``: those an operator re-fenced while the lease stayed its own, and the action."""
    rows = conn.execute(query("membership", "why_fenced"),
                        {"sink": sink, "worker": worker, "buckets": sorted(buckets)}).fetchall()
    return {r[0]: r[1] for r in rows}


def renew_leases(conn: Conn, sink: str, worker: str, fences: dict[int, int], lease_seconds: float) -> set[int]:
    buckets = sorted(fences)
    rows = conn.execute(
        query("membership", "renew_leases"),
        {"sink": sink, "worker": worker, "buckets": buckets, "fences": [fences[b] for b in buckets],
         "lease_seconds": lease_seconds},
    ).fetchall()
    return {r[0] for r in rows}


def vacuum_horizon(conn: Conn) -> tuple[str | None, float | None]:
    """The oldest transaction id that holds back vacuum (as text; None: none does), and for how long its
    transaction has been open (None: not visible to this role)."""
    row = conn.execute(query("membership", "vacuum_horizon")).fetchone()
    return (None, None) if row is None else (str(row[0]), row[1])


def release_leases(conn: Conn, sink: str, worker: str, fences: dict[int, int]) -> set[int]:
    buckets = sorted(fences)
    rows = conn.execute(
        query("membership", "release_leases"),
        {"sink": sink, "worker": worker, "buckets": buckets, "fences": [fences[b] for b in buckets]},
    ).fetchall()
    return {r[0] for r in rows}


def announce_buckets(conn: Conn, buckets: Iterable[int]) -> None:
    """NOTIFY the relays that want these buckets (free now) to try at once."""
    buckets = list(buckets)
    if not buckets:
        return
    conn.execute(query("membership", "announce_buckets"), {"buckets": ",".join(str(b) for b in sorted(buckets))})

