"""Operator actions on an outbox database, as a library: everything ``outbox-relay status``, ``lag``,
``dead-letters``, ``sinks``, ``keys`` and ``retention`` do, one function each, returning dataclasses.

    import psycopg
    from outbox_relay import admin

    with psycopg.connect(dsn, autocommit=True) as conn:
        page = admin.dead_letters(conn, sink="kafka", limit=20)
        for letter in page.records():
            print(letter["event_id"], letter["last_error"])
        admin.retry_key(conn, "order:42", sink="kafka")

Every function takes a connection to a migrated database (``outbox_relay.migrate.check_schema``).
One that changes something runs in one transaction of its own (a savepoint inside the caller's); a
retry, skip or resume wakes the relays holding the buckets concerned at once. Failures raise
OutboxError (or its ConfigurationError) with a message that names the problem: a sink that does not
exist or was dropped, a key with nothing parked, a sink still in use. The CLI only parses arguments,
calls these and prints what they return.
"""

from __future__ import annotations

import getpass
import os
import shlex
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from . import history
from .backlog import SinkBacklog, backlog
from .dsn import one_line
from .errors import ConfigurationError, OutboxError
from .settings import RelaySettings
from .sqlfiles import query

__all__ = [
    "DEAD_LETTERS_LIMIT",
    "SKIPPED_ERROR",
    "DeadLetterPage",
    "DeadLettersChanged",
    "KeyDeadLetters",
    "KeyHead",
    "KeyPause",
    "KeyPaused",
    "KeyResumed",
    "KeyRetried",
    "KeySinkState",
    "KeySkipped",
    "KeyState",
    "PartitionRolled",
    "Retention",
    "RetentionClassSet",
    "SinkBacklog",
    "SinkDrop",
    "SinkRecreated",
    "Status",
    "Table",
    "TopicRetention",
    "backlog",
    "dead_letters",
    "discard_dead_letters",
    "drop_retention_class",
    "drop_sink",
    "history_partitions",
    "key_state",
    "pause_key",
    "recreate_sink",
    "resume_key",
    "retention",
    "retry_dead_letters",
    "retry_key",
    "roll_history",
    "set_retention_class",
    "set_topic_retention",
    "sinks",
    "skip_key",
    "status",
]

Conn = psycopg.Connection[Any]

DEAD_LETTERS_LIMIT = (1, 10_000)  # one page of dead_letters
KEY_DEAD_LETTERS_SHOWN = 5  # key_state: the newest dead letters of the key per sink
# The relays' defaults: "attempt 3 of N", and how recently a relay running a sink was heard from.
DEFAULT_MAX_ATTEMPTS = int(RelaySettings.model_fields["max_attempts"].default)
DEFAULT_WORKER_TTL_SECONDS = float(RelaySettings.model_fields["worker_ttl_seconds"].default)
# What the default retention class keeps unless set (the relays' --retention-seconds), and the span of
# the partition a roll starts (the relays' --partition-seconds).
DEFAULT_RETENTION_SECONDS = float(RelaySettings.model_fields["retention_seconds"].default)
DEFAULT_PARTITION_SECONDS = float(RelaySettings.model_fields["partition_seconds"].default)
# The last error of a dead letter made by skip_key (`outbox-relay keys skip`).
SKIPPED_ERROR = "skipped by an operator (outbox-relay keys skip)"
# admin.sql dead_letters: the keyset position of the first page.
_FIRST_PAGE: dict[str, Any] = {"after_dead_at": None, "after_sink": None, "after_event": None}


@dataclass(frozen=True)
class Table:
    """Rows of one admin query, with its column names (what the CLI prints as a table)."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]

    def records(self) -> list[dict[str, Any]]:
        """Each row as a mapping of column name to value."""
        return [dict(zip(self.columns, r, strict=True)) for r in self.rows]


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


@dataclass(frozen=True)
class Retention:
    """What ``outbox-relay retention list`` shows: the retention classes (keep, topics) and, per class,
    its partitions, size, oldest event and what holds its oldest partition back (docs/history.md)."""

    classes: Table
    history: Table


@dataclass(frozen=True)
class RetentionClassSet:
    """A retention class as ``set_retention_class`` left it: ``keep_seconds`` None keeps its events for
    good; ``follows_relays``: the default class keeps the relays' --retention-seconds again."""

    name: str
    keep_seconds: float | None
    follows_relays: bool


@dataclass(frozen=True)
class TopicRetention:
    """A topic's retention class from the next partition on (``set_topic_retention``)."""

    topic: str
    class_name: str


@dataclass(frozen=True)
class PartitionRolled:
    """``roll_history``: events now go to the range partition ``partition``."""

    partition: str


@dataclass(frozen=True)
class DeadLetterPage(Table):
    """One page of dead letters, newest first; ``more``: another page follows (ask for it with
    ``after=page.last_event_id``)."""

    more: bool

    @property
    def last_event_id(self) -> uuid.UUID | None:
        return self.rows[-1][self.columns.index("event_id")] if self.rows else None


@dataclass(frozen=True)
class DeadLettersChanged:
    """The dead letters a retry queued again, or a discard deleted (event ids sorted as text)."""

    sink: str
    count: int
    event_ids: list[str]


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


@dataclass(frozen=True)
class KeyHead:
    """The parked head of a key for a sink: its next retry, attempts and last error."""

    event_id: uuid.UUID
    type: str
    attempts: int
    next_retry: datetime | None
    retry_in_seconds: float | None
    last_error: str | None
    parked_at: datetime | None


@dataclass(frozen=True)
class KeyPause:
    since: datetime
    by: str
    role: str
    reason: str | None


@dataclass(frozen=True)
class KeyDeadLetters:
    """How many dead letters the key has for the sink, when the last came, and the newest few (records)."""

    count: int
    last_at: datetime | None
    recent: list[dict[str, Any]]


@dataclass(frozen=True)
class KeySinkState:
    """Where one key stands for one sink. ``state`` is one of flowing, retrying, due, paused,
    dead-lettered, unknown; ``summary`` says it in one line."""

    sink: str
    kind: str
    bucket: int
    owner: str | None  # the relay holding the key's bucket now (None: nobody, or its lease expired)
    fence: int | None
    lease_expires_at: datetime | None
    lease_seconds_left: float | None
    head: KeyHead | None
    queued_behind: int
    parked: int
    unread: int
    oldest_unread: datetime | None
    undelivered: int
    stored: int
    dead_letters: KeyDeadLetters
    paused: KeyPause | None
    state: str
    summary: str


@dataclass(frozen=True)
class KeyState:
    """One partition key across sinks (``sinks`` empty: no relay ever registered a sink)."""

    key: str
    bucket: int | None
    max_attempts: int
    sinks: list[KeySinkState]


@dataclass(frozen=True)
class KeyRetried:
    """The head made due now (its relay retries it at once, then ``parked - 1`` events behind it)."""

    sink: str
    key: str
    bucket: int
    event_id: uuid.UUID
    type: str
    attempts: int
    last_error: str | None
    parked: int


@dataclass(frozen=True)
class KeySkipped:
    """The head moved to dead letters; ``now_due`` events behind it are due (held instead if ``paused``)."""

    sink: str
    key: str
    bucket: int
    event_id: uuid.UUID
    type: str
    attempts: int
    last_error: str | None
    now_due: int
    paused: bool


@dataclass(frozen=True)
class KeyPaused:
    sink: str
    key: str
    already_paused: bool
    paused_at: datetime
    paused_by: str
    paused_role: str
    reason: str | None


@dataclass(frozen=True)
class KeyResumed:
    """``was_paused`` False: nothing to resume (the other fields are None)."""

    sink: str
    key: str
    was_paused: bool
    paused_at: datetime | None = None
    bucket: int | None = None
    now_due: int | None = None


def _rows(conn: Conn, name: str, params: dict[str, Any] | None = None) -> Table:
    with conn.cursor() as cur:
        cur.execute(query("admin", name), params or {})
        return Table(tuple(d.name for d in cur.description or []), list(cur.fetchall()))


def _history_rows(conn: Conn, name: str, retention_seconds: float) -> Table:
    columns, rows = history.rows(conn, name, retention_seconds)
    return Table(tuple(columns), rows)


def _time(value: datetime | None) -> str:
    return "" if value is None else value.isoformat(sep=" ", timespec="seconds")


def key_command(action: str, key: str, sink: str) -> str:
    """The ``outbox-relay keys`` command line for ``action`` (the key quoted for a shell)."""
    return f"outbox-relay keys {action} {shlex.quote(key)} --sink {shlex.quote(sink)}"


# --- sinks ---------------------------------------------------------------------------------------


def no_such_sink(conn: Conn, name: str) -> OutboxError:
    """The error for a sink name that is not live: dropped (and when), or never registered."""
    found = _rows(conn, "sink", {"sink": name}).rows
    if found and found[0][1] is not None:
        return OutboxError(f"sink {name!r} was dropped at {found[0][1]:%Y-%m-%d %H:%M:%S%z}")
    return OutboxError(f"no sink named {name!r}")


def _live_sink(conn: Conn, name: str) -> None:
    """Refuse a sink that does not exist or was dropped; lock a live one against a drop until the
    transaction ends."""
    found = _rows(conn, "share_sink", {"sink": name}).rows
    if not found or found[0][1] is not None:
        raise no_such_sink(conn, name)


def sinks(conn: Conn) -> Table:
    """Every sink: kind, when created, whether (and when) dropped."""
    return _rows(conn, "sinks")


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
        pending, parked, dead = _rows(conn, "sink_losses", params).rows[0]
        found = _rows(conn, "lock_sink", params).rows
        if not found:
            raise OutboxError(f"no sink named {name!r}")
        kind, dropped_at = found[0]
        if dropped_at is not None:
            return SinkDrop(sink=name, kind=kind, dropped=False, dropped_at=dropped_at)
        _rows(conn, "lock_sink_cursors", params)
        users = [f"relay {w} ({state}, heard from {seen}s ago) runs it"
                 for w, state, seen in _rows(conn, "sink_workers", params).rows]
        users += [f"{n} bucket(s) leased by {owner}" for owner, n in _rows(conn, "sink_leases", params).rows]
        users += [f"a rebuild of it (sink {sink!r}, started {started:%Y-%m-%d %H:%M}) is in progress and would "
                  f"switch over into it: `outbox-relay rebuild {name} --cancel` first"
                  for sink, started in _rows(conn, "sink_rebuild", params).rows]
        if users and not force:
            cost = (f"{pending} pending event(s) never reach it, {parked} parked event(s) and {dead} dead letter(s) "
                    "are deleted")
            raise OutboxError(f"sink {name!r} is in use: " + "; ".join(users) + ". Stop those relays (or take the "
                              "sink out of their configuration) and run this again, or pass --force: "
                              f"{cost}, and a relay still running it stops")
        _, parked, dead, rebuild_of, shadow = _rows(conn, "drop_sink", params).rows[0]
    return SinkDrop(sink=name, kind=kind, dropped=True, pending_lost=pending, parked_deleted=parked,
                    dead_letters_deleted=dead, in_use=tuple(users), abandoned_rebuild_of=rebuild_of,
                    retired_schema=shadow)


def recreate_sink(conn: Conn, name: str) -> SinkRecreated:
    """Let relays register a dropped sink again (it starts from the oldest retained event)."""
    with conn.transaction():
        found = _rows(conn, "lock_sink", {"sink": name}).rows
        if not found:
            raise OutboxError(f"no sink named {name!r}")
        if found[0][1] is None:
            raise OutboxError(f"sink {name!r} is not dropped: nothing to recreate")
        _rows(conn, "recreate_sink", {"sink": name})
    return SinkRecreated(sink=name, kind=found[0][0])


# --- status --------------------------------------------------------------------------------------


def status(conn: Conn, *, all_databases: bool = False, dead_letter_keys: int = 20,
           retention_seconds: float = DEFAULT_RETENTION_SECONDS) -> Status:
    """Relays, backlog, the oldest open writing transaction (of the outbox's database; of the whole
    server with ``all_databases``), the ``dead_letter_keys`` keys with most dead letters, rebuilds,
    history per retention class (``retention_seconds``: the relays' --retention-seconds, what the
    default class keeps unless set) and history per projection."""
    return Status(
        workers=_rows(conn, "workers"),
        backlog=_rows(conn, "backlog"),
        oldest_open_transaction=_rows(conn, "horizon_holder", {"all_databases": all_databases}),
        dead_letters_by_key=_rows(conn, "dead_letters_by_key", {"sink": None, "limit": dead_letter_keys}),
        rebuilds=_rows(conn, "rebuilds"),
        retention=_history_rows(conn, "by_class", retention_seconds),
        history=_rows(conn, "history"),
    )


# --- retention (history partitions: docs/history.md) ---------------------------------------------


def retention(conn: Conn, retention_seconds: float = DEFAULT_RETENTION_SECONDS) -> Retention:
    """The retention classes and history per class (``retention_seconds``: the relays' setting, what the
    default class keeps unless set)."""
    return Retention(classes=_history_rows(conn, "classes", retention_seconds),
                     history=_history_rows(conn, "by_class", retention_seconds))


def history_partitions(conn: Conn, retention_seconds: float = DEFAULT_RETENTION_SECONDS) -> Table:
    """Every partition of outbox.events: xid range, class, topics, size, what holds it."""
    return _history_rows(conn, "partitions", retention_seconds)


def set_retention_class(conn: Conn, name: str, keep_seconds: float | str | None) -> RetentionClassSet:
    """Create class ``name`` or change its keep: seconds, None (for good), or "relays" (the default class
    only: back to the relays' --retention-seconds). ConfigurationError names a bad name or keep."""
    if keep_seconds == "relays":
        if name != "default":
            raise ConfigurationError("keeping what the relays' --retention-seconds says is for the default class only")
        history.reset_default(conn)
        return RetentionClassSet(name, None, True)
    if isinstance(keep_seconds, str):
        raise ConfigurationError(f"retention class {name!r}: keep must be seconds, None or 'relays', "
                                 f"not {keep_seconds[:100]!r}")
    history.set_class(conn, name, keep_seconds)
    return RetentionClassSet(name, keep_seconds, False)


def drop_retention_class(conn: Conn, name: str) -> None:
    """Remove class ``name``; refused (ConfigurationError) while topics are mapped to it or partitions hold it."""
    history.drop_class(conn, name)


def set_topic_retention(conn: Conn, topic: str, class_name: str) -> TopicRetention:
    """Put ``topic`` in ``class_name`` ('default': back to the default class), from the next partition on."""
    history.map_topic(conn, topic, class_name)
    return TopicRetention(topic, class_name)


def roll_history(conn: Conn, partition_seconds: float = DEFAULT_PARTITION_SECONDS) -> PartitionRolled:
    """End the partition being written and start the next one now (class and topic changes apply from it)."""
    return PartitionRolled(history.roll(conn, partition_seconds))


# --- dead letters --------------------------------------------------------------------------------


def dead_letters(conn: Conn, *, sink: str | None = None, key: str | None = None, limit: int = 50,
                 after: uuid.UUID | str | None = None) -> DeadLetterPage:
    """One page of dead letters (of ``sink``, of ``key``), newest first; ``after``: the event id of the
    last dead letter of the previous page. OutboxError if the sink is not live or ``after`` names no
    dead letter (retried or discarded since)."""
    low, high = DEAD_LETTERS_LIMIT
    if not low <= limit <= high:
        raise ConfigurationError(f"a page of dead letters holds {low}-{high}, not {limit}")
    with conn.transaction():
        if sink:  # a misspelt sink is an error, not "0 dead letters"
            _live_sink(conn, sink)
        position = _FIRST_PAGE
        if after is not None:
            found = _rows(conn, "dead_letter_position", {"event": str(after), "sink": sink}).rows
            if not found:
                of_sink = f" for sink {sink!r}" if sink else ""
                raise OutboxError(f"no dead letter of event {after}{of_sink} (--after takes an event id of the "
                                  "previous page; it may have been retried or discarded since: list again from the "
                                  "start)")
            position = dict(zip(position, found[0], strict=True))
        page = _rows(conn, "dead_letters", {"sink": sink, "key": key, "limit": limit + 1, **position})
    return DeadLetterPage(page.columns, page.rows[:limit], more=len(page.rows) > limit)


def _change_dead_letters(conn: Conn, name: str, sink: str, event_ids: Sequence[uuid.UUID | str] | None,
                         key: str | None, everything: bool) -> DeadLettersChanged:
    if not (event_ids or key or everything):
        raise ConfigurationError("say which dead letters: event ids, a key, or all")
    with conn.transaction():
        _live_sink(conn, sink)
        ids = [str(e) for e in event_ids] if event_ids else None
        rows = _rows(conn, name, {"sink": sink, "event_ids": ids, "key": key}).rows
        if name == "retry_dead_letters":  # the buckets' owners look at their park now, not at their next check
            for bucket in sorted({r[1] for r in rows}):
                _rows(conn, "notify_parked", {"bucket": bucket})
    return DeadLettersChanged(sink=sink, count=len(rows), event_ids=sorted(str(r[0]) for r in rows))


def retry_dead_letters(conn: Conn, sink: str, *, event_ids: Sequence[uuid.UUID | str] | None = None,
                       key: str | None = None, all: bool = False) -> DeadLettersChanged:
    """Queue dead letters of ``sink`` again, due now: these events, this key's (in publish order), or
    ``all`` of them."""
    return _change_dead_letters(conn, "retry_dead_letters", sink, event_ids, key, all)


def discard_dead_letters(conn: Conn, sink: str, *, event_ids: Sequence[uuid.UUID | str] | None = None,
                         key: str | None = None, all: bool = False) -> DeadLettersChanged:
    """Delete dead letters of ``sink`` for good: these events, this key's, or ``all`` of them."""
    return _change_dead_letters(conn, "discard_dead_letters", sink, event_ids, key, all)


# --- keys ----------------------------------------------------------------------------------------


def key_state(conn: Conn, key: str, *, sink: str | None = None,
              max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> KeyState:
    """Where ``key`` stands for each sink (only ``sink`` if given): its bucket and owner, its parked head
    (attempts of ``max_attempts``, next retry, last error), what waits behind it, dead letters, pause."""
    found = _rows(conn, "key_state", {"key": key, "sink": sink})
    if not found.rows:
        if sink:
            raise no_such_sink(conn, sink)
        return KeyState(key=key, bucket=None, max_attempts=max_attempts, sinks=[])  # no relay ran yet
    states = []
    for s in found.records():
        dead = _rows(conn, "dead_letters", {"sink": s["sink"], "key": key, "limit": KEY_DEAD_LETTERS_SHOWN,
                                            **_FIRST_PAGE})
        states.append(_key_sink_state(s, dead.records(), max_attempts))
    return KeyState(key=key, bucket=states[0].bucket, max_attempts=max_attempts, sinks=states)


def _key_sink_state(s: dict[str, Any], dead: list[dict[str, Any]], max_attempts: int) -> KeySinkState:
    """The key_state row of one sink regrouped, with a state and a summary."""
    seconds_left = s["lease_seconds_left"]
    held = s["owner"] is not None and seconds_left is not None and seconds_left > 0
    head = None
    if s["head_event_id"] is not None:
        head = KeyHead(event_id=s["head_event_id"], type=s["head_type"], attempts=s["head_attempts"],
                       next_retry=s["head_next_retry"], retry_in_seconds=s["head_retry_in_seconds"],
                       last_error=s["head_last_error"], parked_at=s["head_parked_at"])
    paused = None
    if s["paused_at"] is not None:
        paused = KeyPause(since=s["paused_at"], by=s["paused_by"], role=s["paused_role"], reason=s["pause_reason"])
    owner = s["owner"] if held else None
    queued_behind = max(0, s["parked"] - 1)
    letters = KeyDeadLetters(count=s["dead_letters"], last_at=s["last_dead_at"], recent=dead)
    state, summary = _key_summary(head, paused, owner, s["bucket"], queued_behind, s["parked"], s["unread"],
                                  s["stored"], letters, max_attempts)
    return KeySinkState(
        sink=s["sink"], kind=s["kind"], bucket=s["bucket"], owner=owner, fence=s["fence"],
        lease_expires_at=s["lease_expires_at"] if held else None, lease_seconds_left=seconds_left if held else None,
        head=head, queued_behind=queued_behind, parked=s["parked"], unread=s["unread"],
        oldest_unread=s["oldest_unread"], undelivered=s["parked"] + s["unread"], stored=s["stored"],
        dead_letters=letters, paused=paused, state=state, summary=summary)


def _failed(head: KeyHead, max_attempts: int) -> str:
    """"attempt 3 of 10 failed: <error>" (a head parked behind a pause or a skipped event has none)."""
    if head.last_error is None:
        return "not attempted yet"
    return f"attempt {head.attempts} of {max_attempts} failed: {one_line(head.last_error)}"


def _key_summary(head: KeyHead | None, paused: KeyPause | None, owner: str | None, bucket: int, queued_behind: int,
                 parked: int, unread: int, stored: int, dead: KeyDeadLetters, max_attempts: int) -> tuple[str, str]:
    """(state, the plain-language line) of one sink's state."""
    nobody = "" if owner else f"; no relay holds bucket {bucket} now"
    if paused is not None:
        text = (f"paused since {_time(paused.since)} by {paused.by} (role {paused.role})"
                + (f": {one_line(paused.reason)}" if paused.reason else "")
                + f"; {parked} parked event(s) held, {unread} not read yet")
        if head is not None and head.last_error is not None:
            text += f" (its head: {_failed(head, max_attempts)})"
        return "paused", text
    if head is not None:
        behind = f"; {queued_behind} event(s) queued behind it" if queued_behind else ""
        wait = head.retry_in_seconds
        if wait is not None and wait > 0:
            return "retrying", f"waiting for a retry in {wait:.0f} s ({_failed(head, max_attempts)}){behind}{nobody}"
        return "due", f"retry due now ({_failed(head, max_attempts)}){behind}{nobody}"
    on_the_way = f"; {unread} event(s) on their way" if unread else ""
    if dead.count:
        last = f": {one_line(dead.recent[0]['last_error'])}" if dead.recent else ""
        return "dead-lettered", (f"dead-lettered head moved on ({dead.count} dead letter(s), the last at "
                                 f"{_time(dead.last_at)}{last}){on_the_way}{nobody if unread else ''}")
    if unread:
        return "flowing", f"flowing ({unread} event(s) not delivered yet){nobody}"
    if not stored:
        return "unknown", ("unknown: no event of this key is stored (never published, a misspelt key, or all its "
                           "events removed by retention)")
    return "flowing", "flowing (nothing waiting)"


def _locked_head(conn: Conn, sink: str, key: str, action: str) -> dict[str, Any]:
    found = _rows(conn, "lock_key_head", {"sink": sink, "key": key})
    if not found.rows:
        raise OutboxError(f"nothing to {action}: no event of key {key!r} is parked for sink {sink!r} "
                          f"(`{key_command('show', key, sink)}` shows where it stands)")
    return found.records()[0]


def _pause(conn: Conn, sink: str, key: str) -> dict[str, Any] | None:
    found = _rows(conn, "paused_key", {"sink": sink, "key": key}).records()
    return found[0] if found else None


def retry_key(conn: Conn, key: str, sink: str) -> KeyRetried:
    """Make the key's parked head due now: its relay retries it at once. OutboxError if nothing is
    parked, or the key is paused (resume it instead)."""
    with conn.transaction():
        _live_sink(conn, sink)
        head = _locked_head(conn, sink, key, "retry")
        paused = _pause(conn, sink, key)
        if paused is not None:
            raise OutboxError(f"key {key!r} is paused for sink {sink!r} (since {_time(paused['paused_at'])}): its "
                              f"events are held; `{key_command('resume', key, sink)}` lets them go and retries the "
                              "head at once")
        _rows(conn, "retry_key_head", {"sink": sink, "bucket": head["bucket"], "xid": head["xid"],
                                       "seq": head["seq"]})
        _rows(conn, "notify_parked", {"bucket": head["bucket"]})
    return KeyRetried(sink=sink, key=key, bucket=head["bucket"], event_id=head["event_id"], type=head["type"],
                      attempts=head["attempts"], last_error=head["last_error"], parked=head["parked"])


def skip_key(conn: Conn, key: str, sink: str, *, event_id: uuid.UUID | str | None = None) -> KeySkipped:
    """Move the key's parked head to dead letters (last error SKIPPED_ERROR); the events behind it are
    due now (held instead while the key is paused). ``event_id``: skip only if that event is the head.
    The key's bucket is fenced first, so an attempt of the head in flight can not land after it."""
    with conn.transaction():
        _live_sink(conn, sink)
        _rows(conn, "fence_key_bucket", {"sink": sink, "key": key})
        head = _locked_head(conn, sink, key, "skip")
        if event_id is not None and str(event_id) != str(head["event_id"]):
            raise OutboxError(f"event {event_id} is not the head of key {key!r} for sink {sink!r} (the head is "
                              f"{head['event_id']}); only the head can be skipped, since the events behind it may "
                              "not go before it")
        paused = _pause(conn, sink, key)
        done = _rows(conn, "skip_key_head", {"sink": sink, "bucket": head["bucket"], "xid": head["xid"],
                                             "seq": head["seq"], "error": SKIPPED_ERROR}).rows
        _rows(conn, "notify_parked", {"bucket": head["bucket"]})
    return KeySkipped(sink=sink, key=key, bucket=head["bucket"], event_id=head["event_id"], type=head["type"],
                      attempts=head["attempts"], last_error=head["last_error"], now_due=int(done[0][1]),
                      paused=paused is not None)


def operator() -> str:
    """Who runs this process, as far as this host knows (a pause records it with the database role)."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name, no USER/LOGNAME (some containers)
        user = f"uid {os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()}"


def pause_key(conn: Conn, key: str, sink: str, *, reason: str | None = None, by: str | None = None) -> KeyPaused:
    """Hold the key's events for the sink (parked, in order, none retried) until ``resume_key``; ``by``
    (default: user@host of this process) and ``reason`` are shown by key_state. Pausing a paused key
    changes nothing (``already_paused``)."""
    with conn.transaction():
        _live_sink(conn, sink)
        for _ in range(3):
            inserted = _rows(conn, "pause_key", {"sink": sink, "key": key, "by": by or operator(),
                                                 "reason": reason}).rows
            # Inserted now, or there already; unless another operator resumed it between the two statements.
            paused = _pause(conn, sink, key)
            if paused is not None:
                break
        else:
            raise OutboxError(f"key {key!r} was paused and resumed by others while this ran; run it again")
    return KeyPaused(sink=sink, key=key, already_paused=not inserted, paused_at=paused["paused_at"],
                     paused_by=paused["paused_by"], paused_role=paused["paused_role"], reason=paused["reason"])


def resume_key(conn: Conn, key: str, sink: str) -> KeyResumed:
    """Let a paused key go: its held events are due at once, in order. A key that is not paused: nothing
    changes (``was_paused`` False)."""
    with conn.transaction():
        _live_sink(conn, sink)
        rows = _rows(conn, "resume_key", {"sink": sink, "key": key}).rows
        if not rows:
            return KeyResumed(sink=sink, key=key, was_paused=False)
        bucket, paused_at, due = rows[0]
        _rows(conn, "notify_parked", {"bucket": bucket})
    return KeyResumed(sink=sink, key=key, was_paused=True, paused_at=paused_at, bucket=bucket, now_due=due)
