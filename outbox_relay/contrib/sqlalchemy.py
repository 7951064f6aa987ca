"""Domain events recorded on a SQLAlchemy ORM session, written by its flushes in its transaction.

ORM code does not write rows when it changes objects: the session flushes them later (before a
query, at ``commit()``), maybe inside savepoints, maybe in a flush that fails and is rolled back.
Calling ``Outbox.publish`` by hand means guessing that moment. Instead, ``track`` hooks the outbox
into a session class or factory, and code ``record``s events next to its changes::

    outbox = Outbox(default_topic="orders")
    Session = sessionmaker(engine)
    track(Session, outbox)

    with Session.begin() as session:
        session.add(Order(id=7, total=30))
        record(session, type="OrderPlaced", key="order:7", payload={"total": 30})
    # committed: the order and its event, or (after an exception) neither

What each situation does:

- Every flush writes the events waiting in the session, after the objects, with one
  ``Outbox.publish_many`` statement on ``session.connection()``. ``commit()`` flushes, and also
  writes events that no flush did (a unit of work that changed no object).
- A rollback of the transaction drops its events, as SQLAlchemy drops the objects added in it (G1).
- A savepoint (``begin_nested``) that rolls back drops the events recorded inside it. Events
  recorded before it stay: if a flush inside the savepoint had written them, they wait again and
  the next flush or the commit writes them, once.
- A flush that fails has rolled the database back to the enclosing savepoint or transaction; the
  two rules above say what survives. Nothing that survives is lost or written twice.
- A repeated idempotency key gives one event (``Recorded.published.created`` says which call made it);
  the same key for another event raises ``IdempotencyConflict`` from the flush, which rolls back.
- Bad events raise ``InvalidEvent`` from ``record``, and a session whose connection is in
  autocommit mode raises ``NoTransaction``: its flushes would commit the objects at once, so
  no event could share their fate. Nothing is recorded then.

The state lives in ``session.info``; everything here runs in SQLAlchemy's session events, so an
``AsyncSession`` works through its ``sync_session`` (``arecord`` is the awaitable ``record``).
"""

from __future__ import annotations

import json
import sys
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import ModuleType
from typing import TYPE_CHECKING, Any

from sqlalchemy import event as sa_event
from sqlalchemy.orm import Session, SessionTransaction, scoped_session, sessionmaker

from ..errors import ConfigurationError, NoTransaction
from ..event import Event
from ..publish import Outbox, Published, check_storable
from ..transactions import require_transaction

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

__all__ = ["Recorded", "arecord", "record", "track"]

_INFO_KEY = "outbox_relay.contrib.sqlalchemy"

# What ``track`` hooked (a Session subclass or one Session) -> the Outbox whose default topic
# ``record`` applies. Weak: a sessionmaker that goes away takes its entry with it.
_tracked: weakref.WeakKeyDictionary[Any, Outbox] = weakref.WeakKeyDictionary()


class Recorded:
    """An event recorded on a session.

    ``published`` is None while the event waits for a flush, and set once one wrote it (``created``
    False: its idempotency key stood for an event stored before). It is None again when the
    savepoint or transaction that wrote it rolls back: the event waits again, or, if it was
    recorded inside what rolled back, it is dropped.
    """

    __slots__ = ("_scope", "_written_in", "event", "published")

    def __init__(self, event: Event, scope: SessionTransaction) -> None:
        self.event = event
        self.published: Published | None = None
        # The innermost transaction (the root, or a savepoint) open when it was recorded and when it
        # was written: a rollback of that one, or of one around it, undoes the recording or the write.
        self._scope = scope
        self._written_in: SessionTransaction | None = None

    def __repr__(self) -> str:
        return f"Recorded({self.event.type!r}, key={self.event.key!r}, published={self.published!r})"


@dataclass
class _Unit:
    """The session's recorded events, in order, until its transaction ends."""

    outbox: Outbox | None = None
    records: list[Recorded] = field(default_factory=list)
    # Commits (of the transaction or a savepoint) past our before_commit and not finished: an event
    # recorded then (by a later before_commit listener) is written at once, since no flush may follow.
    committing: int = 0
    committed: SessionTransaction | None = None  # the last transaction or savepoint that committed


def track(target: Any, outbox: Outbox) -> None:
    """Write the events ``record``ed on the sessions of ``target`` in their flushes, validated by ``outbox``.

    ``target``: a ``sessionmaker`` or ``scoped_session`` (its sessions), a ``Session`` subclass
    (``Session`` itself: every session of the process), one ``Session``; for asyncio an
    ``async_sessionmaker`` or ``async_scoped_session`` (given a private sync session class, so that
    only its sessions are hooked) or one ``AsyncSession``. Tracking again with the same outbox does
    nothing; a session covered twice uses the most specific target's outbox (a session, then its
    class before its base classes), and its events are written once.
    """
    resolved = _resolve(target, outbox)
    known = _tracked.get(resolved)
    if known is not None and known is not outbox:
        raise ConfigurationError(f"{target!r} is already tracked with another Outbox; its sessions can record "
                                 "with one only (track a separate sessionmaker for the other)")
    if known is None:
        # Not sa_event.contains(): its registry is keyed by id(), so a class made after another one was
        # garbage-collected can look hooked already (sessionmakers make a class each).
        for name, listener in _LISTENERS:
            sa_event.listen(resolved, name, listener)
    _tracked[resolved] = outbox


def record(
    session: Session, *, type: str, key: str, payload: Any, topic: str | None = None,
    headers: Mapping[str, str] | None = None, idempotency_key: str | None = None,
    time: datetime | None = None, id: uuid.UUID | None = None,
) -> Recorded:
    """Record an event in the session's unit of work (the fields are ``Outbox.publish``'s).

    It is written by the next flush (``commit()`` flushes) and exists iff the session's transaction
    commits with it: see the module's notes for savepoints and failed flushes. Like ``session.execute``,
    this begins the session's transaction if none is open. The payload is copied (as JSON) now, so
    later changes to what it was built from do not reach the event. Raises ``InvalidEvent`` for a bad event,
    ``NoTransaction`` for an autocommit session, ``ConfigurationError`` for a session ``track`` did not
    hook (its events would never be written); nothing is recorded then.
    """
    aio = _asyncio()
    if aio is not None and isinstance(session, aio.AsyncSession):
        raise TypeError("record() takes a Session; with an AsyncSession use `await arecord(session, ...)`")
    outbox = _outbox_for(session)
    built = _build(outbox, type=type, key=key, payload=payload, topic=topic, headers=headers,
                   idempotency_key=idempotency_key, time=time, id=id)
    recorded, unit = _add(session, outbox, built)
    if unit.committing:
        _write(session)
    return recorded


# ``record`` and ``arecord`` are small drivers over the shared steps (_outbox_for, _build, _add, _write):
# they differ in where they may wait (an AsyncSession's connection, run_sync), nothing else.
async def arecord(
    session: AsyncSession, *, type: str, key: str, payload: Any, topic: str | None = None,
    headers: Mapping[str, str] | None = None, idempotency_key: str | None = None,
    time: datetime | None = None, id: uuid.UUID | None = None,
) -> Recorded:
    """``record`` for an ``AsyncSession`` (in code running inside its events, call ``record`` on the
    ``sync_session`` the event hands over)."""
    outbox = _outbox_for(session.sync_session)
    built = _build(outbox, type=type, key=key, payload=payload, topic=topic, headers=headers,
                   idempotency_key=idempotency_key, time=time, id=id)
    await session.connection()  # the one step that may wait for the database; after it, nothing does
    recorded, unit = _add(session.sync_session, outbox, built)
    if unit.committing:
        await session.run_sync(_write)
    return recorded


# -- internals ------------------------------------------------------------------------------------


def _asyncio() -> ModuleType | None:
    """SQLAlchemy's asyncio module, if this process imported it: without it no AsyncSession exists, and
    importing it needs greenlet, which a program with sync sessions only may not have."""
    return sys.modules.get("sqlalchemy.ext.asyncio")


def _resolve(target: Any, outbox: Outbox) -> Any:
    """The class or session to listen on, as SQLAlchemy's session events resolve ``target``."""
    aio = _asyncio()
    if isinstance(target, scoped_session) or (aio is not None and isinstance(target, aio.async_scoped_session)):
        target = target.session_factory
    if aio is not None and isinstance(target, aio.AsyncSession):
        return target.sync_session
    if aio is not None and isinstance(target, aio.async_sessionmaker):
        sync_class = target.kw.get("sync_session_class") or target.class_.sync_session_class
        if isinstance(sync_class, sessionmaker):
            return sync_class.class_  # a class of its own already
        if not (isinstance(sync_class, type) and issubclass(sync_class, Session)):
            raise TypeError(f"track() can not hook the sessions of {target!r}: its sync_session_class is neither a "
                            "Session class nor a sessionmaker")
        if _tracked.get(sync_class) is outbox:
            return sync_class  # tracked before
        # A subclass of its own (as sessionmaker makes one): listening on a shared class, Session by
        # default, would hook every session of the process.
        own = type(sync_class.__name__, (sync_class,), {})
        target.configure(sync_session_class=own)
        return own
    if isinstance(target, sessionmaker):
        return target.class_
    if isinstance(target, Session) or (isinstance(target, type) and issubclass(target, Session)):
        return target
    raise TypeError(f"track() takes a sessionmaker, scoped_session, Session class or Session, or their asyncio "
                    f"forms (async_sessionmaker, async_scoped_session, AsyncSession); not {target!r}")


def _outbox_for(session: Session) -> Outbox:
    for target in (session, *type(session).__mro__):
        outbox = _tracked.get(target)
        if outbox is not None:
            return outbox
    raise ConfigurationError(
        f"record refused: this {type(session).__name__} is not tracked, so its flushes would never write the "
        "event; call outbox_relay.contrib.sqlalchemy.track() on its sessionmaker (or Session class, or the "
        "session) first. Nothing was recorded.")


def _build(outbox: Outbox, **fields: Any) -> Event:
    """The event as it will be written: everything publish would refuse is refused now, at the call
    that made it, and the payload is a copy (JSON), so later changes to the objects it was built
    from do not reach the event."""
    built = outbox.event(**fields)
    text = built.payload_json()
    check_storable(built, text)
    return built.model_copy(update={"payload": json.loads(text)})


def _add(session: Session, outbox: Outbox, built: Event) -> tuple[Recorded, _Unit]:
    # session.connection() begins the transaction (if none is open), so the event has one to belong
    # to; for an AsyncSession, arecord has acquired the connection, so nothing here waits for IO.
    try:
        require_transaction(session.connection().connection.driver_connection, session)
    except NoTransaction:
        raise NoTransaction(
            "record refused: this session's connection is in autocommit mode (isolation_level='AUTOCOMMIT'), so "
            "each flush would commit its objects at once and no event could share their fate; use a session of "
            "an engine without it. Nothing was recorded.") from None
    unit = _unit(session)
    unit.outbox = outbox
    recorded = Recorded(built, _innermost(session))
    unit.records.append(recorded)
    return recorded, unit


def _unit(session: Session) -> _Unit:
    unit: _Unit | None = session.info.get(_INFO_KEY)
    if unit is None:
        unit = session.info[_INFO_KEY] = _Unit()
    return unit


def _innermost(session: Session) -> SessionTransaction:
    transaction = session.get_nested_transaction() or session.get_transaction()
    assert transaction is not None, "called inside a transaction"
    return transaction


def _within(transaction: SessionTransaction | None, outer: SessionTransaction) -> bool:
    while transaction is not None:
        if transaction is outer:
            return True
        transaction = transaction.parent
    return False


def _write(session: Session) -> None:
    """Write the waiting events, in the order recorded, with one statement."""
    unit = session.info.get(_INFO_KEY)
    waiting = [r for r in unit.records if r.published is None] if unit is not None else []
    if not waiting:
        return
    assert unit is not None and unit.outbox is not None
    published = unit.outbox.publish_many(session, [r.event for r in waiting])
    where = _innermost(session)
    for recorded, result in zip(waiting, published, strict=True):
        recorded.published, recorded._written_in = result, where


# -- session events -------------------------------------------------------------------------------


def _after_flush(session: Session, _flush_context: Any) -> None:
    # After the objects (a failed object write leaves the events waiting, with nothing sent), inside
    # the flush: a failure here fails the flush, which rolls back as for any object.
    _write(session)


def _before_commit(session: Session) -> None:
    # Commit flushes only a session with changed objects, and that flush may find nothing to write
    # (then there is no after_flush): flush now, then write what is still waiting.
    unit = _unit(session)
    if any(r.published is None for r in unit.records):
        session.flush()
        _write(session)
    unit.committing += 1


def _after_commit(session: Session) -> None:
    unit = session.info.get(_INFO_KEY)
    if unit is not None:
        unit.committing = max(0, unit.committing - 1)
        unit.committed = _innermost(session)  # this savepoint, or the transaction: not closed yet


def _after_soft_rollback(session: Session, previous: SessionTransaction) -> None:
    # The database rolled back to the savepoint or transaction around ``previous`` (a failed flush
    # rolls back its own, internal, transaction: the one around it is undone too).
    unit = session.info.get(_INFO_KEY)
    if unit is None:
        return
    undone = previous
    while not undone.nested and undone.parent is not None:
        undone = undone.parent
    unit.committing = 0
    kept = []
    for recorded in unit.records:
        if _within(recorded._written_in, undone):
            recorded.published = recorded._written_in = None  # its row is gone: it waits again
        if not _within(recorded._scope, undone):
            kept.append(recorded)
    unit.records = kept


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is not None:
        return
    unit = session.info.pop(_INFO_KEY, None)
    if unit is not None and unit.committed is not transaction:  # rolled back, or closed without commit
        for recorded in unit.records:
            recorded.published = recorded._written_in = None


_LISTENERS: tuple[tuple[str, Callable[..., None]], ...] = (
    ("after_flush", _after_flush),
    ("before_commit", _before_commit),
    ("after_commit", _after_commit),
    ("after_soft_rollback", _after_soft_rollback),
    ("after_transaction_end", _after_transaction_end),
)
