"""One projection batch's walk, sans-IO: the single place that decides which handler calls a batch
makes, in which order, under which savepoints, and what became of each event.

The walk is a generator. It yields steps, ``Execute`` (a statement of the relay's) or ``Call`` (the
handler, with one event or, for ``batch=True`` projections, a list of events), and is sent a
``Reply`` after each: what the step raised and the transaction's status afterwards. It returns the
batch's ``Outcomes``. A sync and an async driver run it on a connection (``drive`` / ``adrive``);
the live projection sink (sink.py), the rebuild of one key (rebuild.py) and the testing kit's
``apply_projection`` all run it, so their walks can not drift. A whole rebuild is a relay running
the projection sink, so it runs it too.

Two modes, as before this module existed:

- fast (``known`` None): the handler calls with no savepoints; any failure raises ``Redo`` (roll the
  transaction back and walk again carefully), with the failure pinned on its event when it is known
  exactly. A batched handler gets every event of the batch in one call; a failure of that call can
  not be pinned on one event, so the careful walk finds it.
- careful (``known`` given): a savepoint per event and one call per event (a batched handler gets
  one-event lists), so a failing event's writes are undone alone and only it is charged. This is
  the "one at a time" fallback for batched handlers rather than bisection: bisecting needs the
  per-key holds (a key's later events wait behind its failed one) re-derived at each split, and
  costs about log2(n) failed sub-batches per poison event anyway; a failing batch is rare, and one
  careful walk charges exactly the events that fail, with one call each.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import pq

from outbox_relay.errors import NonRetriableDelivery
from outbox_relay.sinks.engine import Aborted, Failure, KeyHold, Outcomes
from outbox_relay.sqlfiles import query
from outbox_relay.store import StoredEvent

from .declare import Projection, describe
from .event import ProjectionEvent

ABORT_CHECK_EVERY = 64  # events between checks of the hard-stop flag

ENDED_TRANSACTION = Failure(
    "the handler ended the relay's transaction (COMMIT, END or ROLLBACK through tx): nothing of its batch was "
    "kept, and this event is not retried; a handler writes through the transaction it is given and never ends "
    "it, so that its writes commit with the relay's checkpoint", retriable=False)

SWALLOWED_ERROR = Failure(
    "a statement of the handler failed and the handler went on (it caught the error): the transaction can not "
    "go on after a failed statement, so this event's writes were undone; use a savepoint (with "
    "tx.transaction()) around a statement that may fail")

# Errors a statement gets once its handler ended the relay's transaction: the commit guard refused
# the COMMIT, a write outside the relay's (read-write) transaction, a savepoint with no transaction.
ENDED_STATES = frozenset({"2D000", "25006", "25P01"})

_NEVER = threading.Event()  # a walk nobody aborts (rebuild of a key, the testing kit)

# An event of a batch: as stored, or already as its handler gets it (a rebuild's bulk phase builds
# those straight from its rows, bulk.py: nothing left to prepare, the walk is the same).
Delivered = StoredEvent | ProjectionEvent[Any]


@dataclass(frozen=True)
class Execute:
    """A statement of the relay's own."""

    sql: str
    params: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Call:
    """One handler call: ``stored`` are its events; ``batch``: the handler takes the list."""

    stored: Sequence[Delivered]
    events: Sequence[ProjectionEvent[Any]]
    batch: bool

    @property
    def argument(self) -> Any:
        return list(self.events) if self.batch else self.events[0]

    @property
    def event(self) -> Delivered | None:
        """The event a hang is charged to (guard.py); None for a call with several, which the careful walk tells."""
        return self.stored[0] if len(self.stored) == 1 else None


Step = Execute | Call


@dataclass(frozen=True)
class Reply:
    error: Exception | None
    status: pq.TransactionStatus
    broken: bool = False


class Redo(Exception):
    """Roll back and redo the batch event by event. ``failed``: failures already pinned on events,
    so the redo does not call their handlers again (an attempt is one call); a failed statement
    in the pipelined path is only known at its next sync, unpinned. ``ended``: the event whose
    handler ended the transaction; whatever failed after it failed outside the batch's
    transaction and is not pinned on those events."""

    def __init__(self, failed: dict[Any, Failure] | None = None, ended: Any = None) -> None:
        super().__init__()
        self.failed = failed or {}
        self.ended = ended


class HandlerExited(Exception):
    """A handler raised ``SystemExit`` or ``KeyboardInterrupt`` (its own code called ``sys.exit``): a
    failure of its event like any error. Raised on, it would end the relay's runner thread."""

    def __init__(self, raised: BaseException) -> None:
        super().__init__()
        self.raised = raised


def failure(exc: BaseException) -> Failure:
    if isinstance(exc, HandlerExited):
        return Failure(describe(exc.raised))
    return Failure(describe(exc), retriable=not isinstance(exc, NonRetriableDelivery))


def ended_by(status: pq.TransactionStatus, exc: BaseException | None) -> bool | None:
    """Whether the handler just called, with no savepoint around it, ended the relay's transaction
    (it was open before the call). None: can not tell (a failed statement also leaves the
    transaction failed), the careful walk will."""
    if status == pq.TransactionStatus.IDLE:
        return True
    cause, seen = exc, 0
    while cause is not None and seen < 20:  # the handler may have wrapped the statement's error
        if isinstance(cause, psycopg.Error) and cause.sqlstate in ENDED_STATES:
            return True
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    if status == pq.TransactionStatus.INERROR and exc is None:
        return None  # failed without raising: a statement error it caught, or a new transaction it began
    return False


@dataclass
class Batch:
    """One run of one batch: which events go to the handler, in order, and what became of each.
    A key whose event failed (retriably) waits: its later events are left out (not attempted)."""

    projection: Projection
    events: Sequence[Delivered]
    fences: Mapping[int, int]  # bucket -> fence (the tokens' first part)
    replay: bool = False
    known: Mapping[Any, Failure] = field(default_factory=dict)  # pinned by an earlier run: not called again
    # Decided before any run, never called: a rebuild follows what live processing decided (decisions.py).
    decided: Mapping[Any, Failure] = field(default_factory=dict)
    name: str = ""
    outcomes: Outcomes = field(default_factory=dict)
    errors: dict[Any, Exception] = field(default_factory=dict)  # what the handler raised, per event
    applied: list[ProjectionEvent[Any]] = field(default_factory=list)  # in the order applied
    waiting: int = 0  # events not attempted: an earlier event of their key failed retriably
    token: str = field(default_factory=lambda: secrets.token_hex(8))  # the commit guard's, for this run
    _hold: KeyHold = field(default_factory=KeyHold)

    def todo(self, abort: threading.Event) -> Iterator[tuple[Delivered, ProjectionEvent[Any]]]:
        """The events for the handler; the walk records each before asking for the next."""
        known = self.known or None  # most runs pin nothing: no lookup (a uuid's hash) per event
        decided = self.decided or None
        for i, e in enumerate(self.events):
            if i % ABORT_CHECK_EVERY == 0 and abort.is_set():
                raise Aborted()
            if not self._hold.allows(e):
                self.waiting += 1
                continue
            pinned = known.get(e.id) if known is not None else None
            if pinned is None and decided is not None:
                pinned = decided.get(e.id)
            prepared = pinned or self._prepare(e)
            if isinstance(prepared, ProjectionEvent):
                yield e, prepared
            elif prepared is not None:
                self.record(e, prepared)

    def _prepare(self, e: Delivered) -> ProjectionEvent[Any] | Failure | None:
        """``Projection.prepare``, with any exception it raises charged to the event (it is the event's
        stored form that could not be handed over: no retry changes that)."""
        if isinstance(e, ProjectionEvent):  # prepared already (the bulk phase)
            return e
        try:
            return self.projection.prepare(e, self.fences[e.bucket], self.replay)
        except Exception as exc:
            return Failure(f"the event could not be prepared for the handler: {describe(exc)}", retriable=False)

    def record(self, e: Delivered, outcome: Failure | None, event: ProjectionEvent[Any] | None = None) -> None:
        self.outcomes[e.id] = outcome
        self._hold.record(e, outcome)
        if outcome is None and event is not None:
            self.applied.append(event)

    def record_applied(self, pairs: Sequence[tuple[Delivered, ProjectionEvent[Any]]]) -> None:
        """``record(e, None, event)`` for each pair, at once (a batched call's events all succeeded)."""
        self.outcomes.update(dict.fromkeys(e.id for e, _ in pairs))
        self.applied.extend(p for _, p in pairs)

    def settle(self, e: Delivered, event: ProjectionEvent[Any], exc: Exception | None, *, ended: bool | None,
               undone: bool) -> None:
        """Record what became of ``e`` after its handler call: ``exc`` what it raised, ``ended``
        whether it ended the batch's transaction (None: unknown), ``undone`` whether its writes
        were undone alone (a savepoint; else the run can not go on after a failure).

        Raises ``Redo`` to roll back and run the batch again, with what is known pinned on ``e``."""
        if ended:
            raise Redo({e.id: ENDED_TRANSACTION}, ended=e.id)
        if ended is None:
            raise Redo()  # the careful walk tells
        outcome = None if exc is None else failure(exc)
        if exc is None and undone:
            outcome = SWALLOWED_ERROR
        if outcome is not None and not undone:
            raise Redo({e.id: outcome}) from exc
        if exc is not None:
            self.errors[e.id] = exc
        self.record(e, outcome, event)


Walk = Generator[Step, Reply, Outcomes]


def walk(batch: Batch, *, careful: bool, pipelined: bool = False, begin: Mapping[str, Any] | None = None,
         end: bool = True, abort: threading.Event = _NEVER) -> Walk:
    """The walk of one run of ``batch`` (see the module docstring). ``pipelined``: the driver runs the
    fast walk in a pipeline, where a failed statement is only known at the next sync (the driver
    turns it into ``Redo``). ``begin``: the parameters of ``begin_batch`` (None: no begin step, as
    in the testing kit or when the driver began it); ``end``: end with ``end_batch`` (the commit
    guard's token: the transaction may commit)."""
    if begin is not None:
        reply = yield Execute(query("projections", "begin_batch"), {**begin, "token": batch.token})
        if reply.error is not None:
            raise reply.error
    batched = batch.projection.batch
    if careful:
        for e, event in batch.todo(abort):
            yield from _careful_call(batch, e, event, batched)
    elif batched:
        todo = list(batch.todo(abort))
        if todo:
            reply = yield Call([e for e, _ in todo], [p for _, p in todo], batch=True)
            if reply.error is not None and pipelined and isinstance(reply.error, psycopg.Error):
                raise reply.error  # which statement failed is known at the next sync: the driver's Redo
            if reply.error is not None or ended_by(reply.status, None) is not False:
                raise Redo() from reply.error  # which event failed: the careful walk tells
            batch.record_applied(todo)
    else:
        for e, event in batch.todo(abort):
            reply = yield Call([e], [event], batch=False)
            if pipelined:
                if isinstance(reply.error, psycopg.Error):
                    raise reply.error
                if reply.error is not None:  # the handler's own: attributed exactly
                    raise Redo({e.id: failure(reply.error)}) from reply.error
                batch.record(e, None, event)
            else:
                batch.settle(e, event, reply.error, ended=ended_by(reply.status, reply.error), undone=False)
    if end:
        reply = yield Execute(query("projections", "end_batch"), {"token": batch.token})
        if reply.error is not None:
            if careful:
                raise reply.error
            raise Redo() from reply.error  # a handler ended the transaction and began another: the careful walk tells
    return batch.outcomes


def _careful_call(batch: Batch, e: Delivered, event: ProjectionEvent[Any], batched: bool) -> Generator[
        Step, Reply, None]:
    reply = yield Execute(query("projections", "event_savepoint"))  # undo only this event's writes
    if reply.error is not None:
        raise reply.error
    called = yield Call([e], [event], batch=batched)
    error = called.error
    state = "ended"
    if called.status != pq.TransactionStatus.IDLE:
        # The savepoint is gone if the handler ended the batch's transaction (COMMIT, END or
        # ROLLBACK, maybe followed by a BEGIN): then releasing or undoing it fails.
        keep = error is None and called.status == pq.TransactionStatus.INTRANS
        closed = yield Execute(query("projections", "event_release" if keep else "event_rollback"))
        if closed.error is None:
            state = "kept" if keep else "undone"
    batch.settle(e, event, error, ended=state == "ended", undone=state == "undone")


def redo_known(events: Sequence[Delivered], known: Mapping[Any, Failure] | None, redo: Redo) -> dict[Any, Failure]:
    """The failures the next run of a batch starts from."""
    merged = dict(known or {})
    if redo.ended is not None:
        # Later events failed outside the batch's transaction (e.g. read-only after a ROLLBACK):
        # not their fault. The next run calls them again.
        order = {e.id: i for i, e in enumerate(events)}
        merged = {k: v for k, v in merged.items() if order[k] < order[redo.ended]}
    merged.update(redo.failed)
    return merged


def max_runs(events: Sequence[Delivered]) -> int:
    """Runs of one batch: the fast one, then careful ones. A careful run is redone only when it
    pinned one more event (whose handler ended the transaction) and never calls a pinned one
    again, so handlers that behave the same each time need at most one careful run per event."""
    return len(events) + 2


# -- what the drivers (drive.py, drive_async.py) share ------------------------------------------

Handler = Callable[[Any, Any], Any]
OnCall = Callable[[Delivered | None], None]  # told before each handler call (None: after it returned)


def no_call_listener(_: Delivered | None) -> None:
    """The default ``OnCall``: nobody is told."""
