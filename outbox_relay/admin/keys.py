"""One partition key across sinks: where it stands, and an operator's retry, skip, pause and resume of it."""

from __future__ import annotations

import getpass
import os
import shlex
import socket
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..dsn import one_line
from ..errors import OutboxError
from .dead_letter_ops import FIRST_PAGE
from .sink_lifecycle import live_sink, no_such_sink
from .table import DEFAULT_MAX_ATTEMPTS, Conn, fetch_table, time_text

KEY_DEAD_LETTERS_SHOWN = 5  # key_state: the newest dead letters of the key per sink
# The last error of a dead letter made by skip_key (`outbox-relay keys skip`).
SKIPPED_ERROR = "skipped by an operator (outbox-relay keys skip)"


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

    @classmethod
    def of_row(cls, row: dict[str, Any]) -> KeyHead:
        """The head in a row of key_state or waiting_keys (their ``head_*`` columns)."""
        return cls(event_id=row["head_event_id"], type=row["head_type"], attempts=row["head_attempts"],
                   next_retry=row["head_next_retry"], retry_in_seconds=row["head_retry_in_seconds"],
                   last_error=row["head_last_error"], parked_at=row["head_parked_at"])


@dataclass(frozen=True)
class KeyPause:
    since: datetime
    by: str
    role: str
    reason: str | None

    @classmethod
    def of_row(cls, row: dict[str, Any]) -> KeyPause | None:
        """The pause in a row of key_state or waiting_keys (their ``paused_*`` columns); None: not paused."""
        if row["paused_at"] is None:
            return None
        return cls(since=row["paused_at"], by=row["paused_by"], role=row["paused_role"], reason=row["pause_reason"])


def lease_holder(row: dict[str, Any]) -> str | None:
    """The relay whose lease on the key's bucket is live, in a row of key_state or waiting_keys."""
    left = row["lease_seconds_left"]
    return row["owner"] if row["owner"] is not None and left is not None and left > 0 else None


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
class KeyHeadAction:
    """The parked head an operator retried or skipped, as it was."""

    sink: str
    key: str
    bucket: int
    event_id: uuid.UUID
    type: str
    attempts: int
    last_error: str | None


@dataclass(frozen=True)
class KeyRetried(KeyHeadAction):
    """The head made due now (its relay retries it at once, then ``parked - 1`` events behind it)."""

    parked: int


@dataclass(frozen=True)
class KeySkipped(KeyHeadAction):
    """The head moved to dead letters; ``now_due`` events behind it are due (held instead if ``paused``)."""

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


def key_command(action: str, key: str, sink: str) -> str:
    """The ``outbox-relay keys`` command line for ``action`` (the key quoted for a shell)."""
    return f"outbox-relay keys {action} {shlex.quote(key)} --sink {shlex.quote(sink)}"


def key_state(conn: Conn, key: str, *, sink: str | None = None,
              max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> KeyState:
    """Where ``key`` stands for each sink (only ``sink`` if given): its bucket and owner, its parked head
    (attempts of ``max_attempts``, next retry, last error), what waits behind it, dead letters, pause."""
    found = fetch_table(conn, "key_state", {"key": key, "sink": sink})
    if not found.rows:
        if sink:
            raise no_such_sink(conn, sink)
        return KeyState(key=key, bucket=None, max_attempts=max_attempts, sinks=[])  # no relay ran yet
    states = []
    for s in found.records():
        dead = fetch_table(conn, "dead_letters", {"sink": s["sink"], "key": key, "limit": KEY_DEAD_LETTERS_SHOWN,
                                            **FIRST_PAGE})
        states.append(_key_sink_state(s, dead.records(), max_attempts))
    return KeyState(key=key, bucket=states[0].bucket, max_attempts=max_attempts, sinks=states)


def _key_sink_state(s: dict[str, Any], dead: list[dict[str, Any]], max_attempts: int) -> KeySinkState:
    """The key_state row of one sink regrouped, with a state and a summary."""
    owner = lease_holder(s)
    held = owner is not None
    head = KeyHead.of_row(s) if s["head_event_id"] is not None else None
    paused = KeyPause.of_row(s)
    queued_behind = max(0, s["parked"] - 1)
    letters = KeyDeadLetters(count=s["dead_letters"], last_at=s["last_dead_at"], recent=dead)
    state, summary = key_summary(head, paused, owner, s["bucket"], queued_behind, s["parked"], s["unread"],
                                  s["stored"], letters, max_attempts)
    return KeySinkState(
        sink=s["sink"], kind=s["kind"], bucket=s["bucket"], owner=owner, fence=s["fence"],
        lease_expires_at=s["lease_expires_at"] if held else None,
        lease_seconds_left=s["lease_seconds_left"] if held else None,
        head=head, queued_behind=queued_behind, parked=s["parked"], unread=s["unread"],
        oldest_unread=s["oldest_unread"], undelivered=s["parked"] + s["unread"], stored=s["stored"],
        dead_letters=letters, paused=paused, state=state, summary=summary)


def _failed(head: KeyHead, max_attempts: int) -> str:
    """"attempt 3 of 10 failed: <error>" (a head parked behind a pause or a skipped event has none)."""
    if head.last_error is None:
        return "not attempted yet"
    return f"attempt {head.attempts} of {max_attempts} failed: {one_line(head.last_error)}"


def key_summary(head: KeyHead | None, paused: KeyPause | None, owner: str | None, bucket: int, queued_behind: int,
                parked: int, unread: int | None, stored: int, dead: KeyDeadLetters,
                max_attempts: int) -> tuple[str, str]:
    """(state, the plain-language line) of one sink's state, in the words of ``keys show`` (the console's
    sink page says it of each waiting key; ``unread`` None: not counted, left out of the line)."""
    nobody = "" if owner else f"; no relay holds bucket {bucket} now"
    if paused is not None:
        text = (f"paused since {time_text(paused.since)} by {paused.by} (role {paused.role})"
                + (f": {one_line(paused.reason)}" if paused.reason else "")
                + f"; {parked} parked event(s) held" + ("" if unread is None else f", {unread} not read yet"))
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
                                 f"{time_text(dead.last_at)}{last}){on_the_way}{nobody if unread else ''}")
    if unread:
        return "flowing", f"flowing ({unread} event(s) not delivered yet){nobody}"
    if not stored:
        return "unknown", ("unknown: no event of this key is stored (never published, a misspelt key, or all its "
                           "events removed by retention)")
    return "flowing", "flowing (nothing waiting)"


def _locked_head(conn: Conn, sink: str, key: str, action: str) -> dict[str, Any]:
    found = fetch_table(conn, "lock_key_head", {"sink": sink, "key": key})
    if not found.rows:
        raise OutboxError(f"nothing to {action}: no event of key {key!r} is parked for sink {sink!r} "
                          f"(`{key_command('show', key, sink)}` shows where it stands)")
    return found.records()[0]


def _pause(conn: Conn, sink: str, key: str) -> dict[str, Any] | None:
    found = fetch_table(conn, "paused_key", {"sink": sink, "key": key}).records()
    return found[0] if found else None


def _acted_on(sink: str, key: str, head: dict[str, Any]) -> dict[str, Any]:
    """The KeyHeadAction fields of a head locked for retry or skip."""
    return {"sink": sink, "key": key, "bucket": head["bucket"], "event_id": head["event_id"], "type": head["type"],
            "attempts": head["attempts"], "last_error": head["last_error"]}


def retry_key(conn: Conn, key: str, sink: str) -> KeyRetried:
    """Make the key's parked head due now: its relay retries it at once. OutboxError if nothing is
    parked, or the key is paused (resume it instead)."""
    with conn.transaction():
        live_sink(conn, sink)
        head = _locked_head(conn, sink, key, "retry")
        paused = _pause(conn, sink, key)
        if paused is not None:
            raise OutboxError(f"key {key!r} is paused for sink {sink!r} (since {time_text(paused['paused_at'])}): its "
                              f"events are held; `{key_command('resume', key, sink)}` lets them go and retries the "
                              "head at once")
        fetch_table(conn, "retry_key_head", {"sink": sink, "bucket": head["bucket"], "xid": head["xid"],
                                       "seq": head["seq"]})
        fetch_table(conn, "notify_parked", {"bucket": head["bucket"]})
    return KeyRetried(**_acted_on(sink, key, head), parked=head["parked"])


def skip_key(conn: Conn, key: str, sink: str, *, event_id: uuid.UUID | str | None = None) -> KeySkipped:
    """Move the key's parked head to dead letters (last error SKIPPED_ERROR); the events behind it are
    due now (held instead while the key is paused). ``event_id``: skip only if that event is the head.
    The key's bucket is fenced first, so an attempt of the head in flight can not land after it."""
    with conn.transaction():
        live_sink(conn, sink)
        fetch_table(conn, "fence_key_bucket", {"sink": sink, "key": key})
        head = _locked_head(conn, sink, key, "skip")
        if event_id is not None and str(event_id) != str(head["event_id"]):
            raise OutboxError(f"event {event_id} is not the head of key {key!r} for sink {sink!r} (the head is "
                              f"{head['event_id']}); only the head can be skipped, since the events behind it may "
                              "not go before it")
        paused = _pause(conn, sink, key)
        done = fetch_table(conn, "skip_key_head", {"sink": sink, "bucket": head["bucket"], "xid": head["xid"],
                                             "seq": head["seq"], "error": SKIPPED_ERROR}).rows
        fetch_table(conn, "notify_parked", {"bucket": head["bucket"]})
    return KeySkipped(**_acted_on(sink, key, head), now_due=int(done[0][1]), paused=paused is not None)


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
        live_sink(conn, sink)
        for _ in range(3):
            inserted = fetch_table(conn, "pause_key", {"sink": sink, "key": key, "by": by or operator(),
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
        live_sink(conn, sink)
        rows = fetch_table(conn, "resume_key", {"sink": sink, "key": key}).rows
        if not rows:
            return KeyResumed(sink=sink, key=key, was_paused=False)
        bucket, paused_at, due = rows[0]
        fetch_table(conn, "notify_parked", {"bucket": bucket})
    return KeyResumed(sink=sink, key=key, was_paused=True, paused_at=paused_at, bucket=bucket, now_due=due)
