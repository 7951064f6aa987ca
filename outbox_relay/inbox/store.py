"""The inbox's transactions: one message applied with its dedupe record and position, dead letters,
leases on partitions. No loop here (``consumer.py``), no argv (``cli.py``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg.pq import TransactionStatus

from ..errors import MAX_ERROR_CHARS, LeaseLost, OutboxError
from ..sqlfiles import query
from ..timelimit import Call, Deadline, cap_exceeded
from .message import InboxMessage, header_lists

Handler = Callable[[InboxMessage, psycopg.Connection[Any]], object]
Outcome = Literal["applied", "duplicate"]

# The error an attempt recorded before it was made keeps if the process dies during it.
CRASH_ERROR = ("the consumer process stopped while applying this message alone (killed, out of memory, os._exit, "
               "a crash in native code, or its database connection and lease lost)")


class HandlerTimeout(OutboxError):
    """The handler did not return within the time limit; its transaction was rolled back (connection closed)."""


class HandlerBrokeTransaction(OutboxError):
    """The handler committed, rolled back or left the transaction failed: its effects and the dedupe
    record would no longer commit together, so the attempt fails."""


class InboxStuck(OutboxError):
    """Too many handlers that never returned are left on abandoned threads: the consumer stops (its
    leases lapse and another process takes its partitions)."""


@dataclass(frozen=True)
class Lease:
    """Who applies a partition's messages now: a consumer process and the fence of its claim."""

    consumer: str
    member: str
    fence: int


class TimeLimit:
    """Runs a handler on a thread of its own and gives up waiting after ``seconds`` (timelimit.py).

    Python can not stop a thread: the caller's connection is closed so nothing the handler does
    later can commit, and the thread is abandoned. Once the process is over its cap of abandoned
    threads (``timelimit.MAX_ABANDONED``, counted with the relay's sinks), no handler is started: the
    consumer stops (``InboxStuck``) before threads pile up."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        # One thread reused for every handler (a new thread per message cost more than the handler of
        # a single INSERT).
        self._deadline = Deadline("inbox-handler", seconds)

    def call(self, handler: Handler, message: InboxMessage, conn: psycopg.Connection[Any]) -> None:
        if why := cap_exceeded("handlers"):
            raise InboxStuck(why)
        call = Call(lambda: handler(message, conn))
        self._deadline.start(call)
        if self._deadline.wait(call) != "done":
            call.abandon()  # the inbox commits on the caller's thread: nothing to race with
            self._deadline.give_up()  # the cap is checked before the next handler starts
            with suppress(Exception):
                conn.cancel_safe(timeout=1.0)
            conn.close()  # whatever the handler still does on it can not commit
            raise HandlerTimeout(f"the handler did not return within {self.seconds:g}s (handler_timeout_seconds); "
                                 "its transaction was rolled back")
        call.result()

    def close(self) -> None:
        self._deadline.close()


def _run_handler(handler: Handler, message: InboxMessage, conn: psycopg.Connection[Any],
                 limit: TimeLimit | None) -> None:
    """Call the handler; the caller holds a savepoint (``conn.transaction()``), inside which psycopg refuses
    a commit() or rollback(), so a handler can not commit the dedupe record without the rest of its work."""
    try:
        if limit is None:
            handler(message, conn)
        else:
            limit.call(handler, message, conn)
    except psycopg.ProgrammingError as exc:
        if "forbidden within a Transaction context" in str(exc):
            raise HandlerBrokeTransaction("the handler called commit() or rollback(): it must only run statements "
                                          "on the connection it is given; the inbox commits") from exc
        raise
    status = conn.info.transaction_status
    if status != TransactionStatus.INTRANS:
        what = "left the transaction failed (an error it caught)" if status == TransactionStatus.INERROR \
            else "ended the transaction (commit or rollback)"
        raise HandlerBrokeTransaction(f"the handler {what}: it must only run statements on the connection it is "
                                      "given; the inbox commits")


def _rollback(conn: psycopg.Connection[Any]) -> None:
    if not conn.closed:
        with suppress(psycopg.Error):
            conn.rollback()


def _params(lease: Lease, message: InboxMessage) -> dict[str, Any]:
    return {"consumer": lease.consumer, "member": lease.member, "fence": lease.fence, "topic": message.topic,
            "partition": message.partition, "offset": message.offset, "message_id": message.id}


def apply_message(conn: psycopg.Connection[Any], lease: Lease, message: InboxMessage, handler: Handler,
                  limit: TimeLimit | None = None) -> Outcome:
    """Apply one message exactly once, in one transaction on ``conn`` (not autocommit), committed here:
    the partition's lease is checked and its row locked, the dedupe record inserted (a duplicate skips
    the handler), the handler run, the position moved past the message. Raises LeaseLost (nothing
    written), or what the handler raised (all rolled back)."""
    batch = apply_batch(conn, lease, [message], handler, limit)
    if batch.failure is not None:
        raise batch.failure
    return batch.outcomes[0]


@dataclass
class Batch:
    """What ``apply_batch`` committed: the outcomes of the first ``len(outcomes)`` messages, and the
    error of the next one (not applied; nothing after it was tried)."""

    outcomes: list[Outcome]
    failure: Exception | None = None


def apply_batch(conn: psycopg.Connection[Any], lease: Lease, messages: list[InboxMessage], handler: Handler,
                limit: TimeLimit | None = None) -> Batch:
    """Apply consecutive messages of one partition, in offset order, in one transaction: one commit (one
    WAL flush) and one statement for all their dedupe records, then the handler of each new one.

    Optimistic: a handler that raises rolls the whole transaction back, then the messages before it are
    applied again (their handlers ran without error) and its error is returned with them. Raises
    LeaseLost (nothing written), and what leaves nothing to go on with (a handler past its time limit,
    which closed the connection, or a database error: nothing of the batch committed; the index of the
    message whose handler was running is the exception's ``inbox_index``)."""
    assert messages and len({(m.topic, m.partition) for m in messages}) == 1
    first = messages[0]
    p = _params(lease, first)
    outcomes: list[Outcome] = []
    try:
        # An outer transaction block: psycopg refuses a commit() or rollback() inside it, so a handler
        # can not commit the dedupe records without the rest of the batch.
        with conn.transaction():
            if conn.execute(query("inbox", "lock_position"), p).fetchone() is None:
                raise LeaseLost(f"partition {first.topic}/{first.partition} is no longer this process's "
                                f"(fence {lease.fence})")
            fresh = {r[0] for r in conn.execute(query("inbox", "record_messages"), {
                **p, "ids": [m.id for m in messages], "offsets": [m.offset for m in messages]})}
            for index, message in enumerate(messages):
                if message.id not in fresh:
                    outcomes.append("duplicate")
                    continue
                fresh.discard(message.id)  # a second copy in the same batch is a duplicate
                try:
                    _run_handler(handler, message, conn, limit)
                except Exception as exc:
                    exc.inbox_index = index  # type: ignore[attr-defined]
                    raise
                outcomes.append("applied")
            last = messages[-1]
            applied = outcomes.count("applied")
            conn.execute(query("inbox", "advance"), {**_params(lease, last), "next_offset": last.offset + 1,
                                                     "applied": applied, "duplicates": len(outcomes) - applied,
                                                     "dead": 0, "first_id": first.id})
    except Exception as exc:
        _rollback(conn)
        failed_at: int | None = getattr(exc, "inbox_index", None)
        if failed_at is None or conn.closed or conn.broken or isinstance(exc, HandlerTimeout | InboxStuck):
            raise
        before = apply_batch(conn, lease, messages[:failed_at], handler, limit) if failed_at else Batch([])
        return before if before.failure is not None else Batch(before.outcomes, exc)
    except BaseException:
        _rollback(conn)
        raise
    return Batch(outcomes)


def dead_letter(conn: psycopg.Connection[Any], lease: Lease, message: InboxMessage, attempts: int, error: str) -> None:
    """Keep the message in dead letters and move the partition past it, in one transaction."""
    p = _params(lease, message)
    names, values = header_lists(message.headers)
    try:
        if conn.execute(query("inbox", "lock_position"), p).fetchone() is None:
            raise LeaseLost(f"partition {message.topic}/{message.partition} is no longer this process's")
        conn.execute(query("inbox", "add_dead_letter"), {
            **p, "key": message.key, "value": message.value, "header_names": names, "header_values": values,
            "message_time": message.timestamp, "attempts": attempts, "error": error[:MAX_ERROR_CHARS]})
        conn.execute(query("inbox", "advance"), {**p, "next_offset": message.offset + 1, "applied": 0,
                                                 "duplicates": 0, "dead": 1, "first_id": message.id})
        conn.commit()
    except BaseException:
        _rollback(conn)
        raise


def record_attempt(conn: psycopg.Connection[Any], lease: Lease, message: InboxMessage, attempts: int,
                   error: str = CRASH_ERROR) -> None:
    """Commit, before the attempt is made, that ``message`` (its partition's head) has had ``attempts``
    attempts counting this one, and ``error`` if the process dies during it. Raises LeaseLost."""
    try:
        row = conn.execute(query("inbox", "record_attempt"), {
            **_params(lease, message), "attempts": attempts, "error": error[:MAX_ERROR_CHARS]}).fetchone()
        conn.commit()
    except BaseException:
        _rollback(conn)
        raise
    if row is None:
        raise LeaseLost(f"partition {message.topic}/{message.partition} is no longer this process's")


def record_failure(conn: psycopg.Connection[Any], lease: Lease, message: InboxMessage, error: str) -> None:
    """A recorded attempt raised: keep its error instead of the crash's (best effort: it only words the
    dead letter a later process may write)."""
    try:
        conn.execute(query("inbox", "attempt_failed"), {**_params(lease, message), "error": error[:MAX_ERROR_CHARS]})
        conn.commit()
    except BaseException:
        _rollback(conn)
        raise


def message_of_dead_letter(row: dict[str, Any]) -> InboxMessage:
    names, values = row["header_names"] or [], row["header_values"] or []
    return InboxMessage(topic=row["topic"], partition=row["partition"], offset=row["offset"],
                        key=_bytes(row["key"]), value=_bytes(row["value"]),
                        headers=tuple((n, _bytes(v)) for n, v in zip(names, values, strict=True)),
                        timestamp=row["message_time"], late=True)


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


def retry_one_dead_letter(conn: psycopg.Connection[Any], consumer: str, handler: Handler,
                          limit: TimeLimit | None = None) -> tuple[int, Outcome | str] | None:
    """Apply the oldest dead letter an operator asked to retry: applied (the dead letter goes), a duplicate
    (its ce_id was applied since: it goes too, the handler is not called), gone (an operator dropped it
    meanwhile, or another retry of it committed first) or the new error (it stays, with
    the error, until asked again). None: nothing asked.

    Two transactions: the first takes the request and counts the attempt (committed, so a handler that
    kills the process uses the request up instead of killing every consumer that starts); the second
    deletes the dead letter, inserts its dedupe record and runs the handler, all or nothing. The message
    is applied late (``InboxMessage.late``): its partition went on past it when it was dead-lettered."""
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        try:
            row = cur.execute(query("inbox", "take_dead_letter"), {"consumer": consumer, "error": CRASH_ERROR}
                              ).fetchone()
            conn.commit()
        except BaseException:
            _rollback(conn)
            raise
    if row is None:
        return None
    message = message_of_dead_letter(row)
    p = {"consumer": consumer, "message_id": message.id, "topic": message.topic,
         "partition": message.partition, "offset": message.offset, "id": row["id"]}
    try:
        if conn.execute(query("inbox", "delete_dead_letter"), p).fetchone() is None:
            conn.rollback()
            return row["id"], "gone"  # dropped meanwhile, or applied by another retry
        fresh = conn.execute(query("inbox", "record_message"), p).fetchone() is not None
        if fresh:
            with conn.transaction():
                _run_handler(handler, message, conn, limit)
        conn.commit()
        return row["id"], ("applied" if fresh else "duplicate")
    except BaseException as exc:
        _rollback(conn)
        if isinstance(exc, HandlerTimeout):
            exc.dead_letter_id = row["id"]  # type: ignore[attr-defined]  # the caller marks it on a new connection
        if conn.closed or conn.broken or not isinstance(exc, Exception) or isinstance(exc, InboxStuck):
            raise
        error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        with conn.transaction():
            conn.execute(query("inbox", "retry_failed"), {"id": row["id"], "error": error})
        return row["id"], error
