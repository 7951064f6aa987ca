"""Applying a held partition's messages: batches in one transaction, a suspect's or a retry's attempt alone
and recorded first, failures held with backoff (only their partition waits), dead letters past
``max_attempts``. It owns the applying connection (transactions) and the handler's time limit; only the
consumer's thread calls it."""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg

from ..backoff import Backoff
from ..crashloop import FIRST_PROBE, HEALTHY, next_probe_size
from ..dsn import redact
from ..errors import LeaseLost, counted
from .message import InboxMessage
from .partitions import Partition, PartitionBook, Stats
from .settings import InboxSettings
from .store import (
    CRASH_ERROR,
    Handler,
    HandlerTimeout,
    InboxStuck,
    Lease,
    TimeLimit,
    apply_batch,
    dead_letter,
    record_attempt,
    record_failure,
)
from .upkeep import retry_dead_letters, usable

log = logging.getLogger("outbox_relay.inbox")

DATABASE_BACKOFF = Backoff(0.5, 10.0)  # a database that is down: the message waits, no attempt counted


class Applier:
    def __init__(self, settings: InboxSettings, handler: Handler, backoff: Backoff, book: PartitionBook,
                 stats: Stats) -> None:
        self.settings = settings
        self.handler = handler
        self.backoff = backoff
        self.limit = TimeLimit(settings.handler_timeout_seconds)
        self.book = book
        self.partitions = book.partitions
        self.stats = stats
        self.db: psycopg.Connection[Any] | None = None  # set by the consumer's start()
        self.db_failures = 0

    @property
    def dsn(self) -> str:
        return self.settings.dsn.get_secret_value()

    def lease(self, p: Partition) -> Lease:
        return Lease(self.settings.consumer, self.settings.member_id, p.fence)

    def apply_next(self, p: Partition, messages: list[InboxMessage]) -> tuple[int, int]:
        """Apply the next batch of ``messages`` (consecutive, of ``p``): (how many the batch took, how many
        were applied or skipped). A batch that does not pass all it took holds, drops or re-reads ``p``."""
        first = messages[0]
        problem = first.id_problem
        if problem is not None:
            p.attempt_id, p.attempts = first.id, 0
            self.give_up(p, first, f"not applied: {problem}")
            return 1, 0
        if first.id == p.attempt_id or p.ramp == FIRST_PROBE:
            return 1, self.apply_alone(p, first)
        size = self.settings.batch_size if p.ramp == HEALTHY else min(p.ramp, self.settings.batch_size)
        batch = messages[:size]
        # A message whose id can not be stored ends the batch: its turn comes next, alone (above).
        unusable = next((i for i, m in enumerate(batch) if m.id_problem is not None), len(batch))
        batch = batch[:unusable]
        return len(batch), self.apply(p, batch)

    def apply_alone(self, p: Partition, message: InboxMessage) -> int:
        """An attempt that may end the process (a retry, or the first message after a lapse): recorded,
        committed, before it is made; past ``max_attempts`` the message is dead-lettered uncalled."""
        if not self.connected(p, message):
            return 0
        assert self.db is not None
        made = p.attempts if p.attempt_id == message.id else 0
        if made >= self.settings.max_attempts:
            p.attempt_id, p.attempts = message.id, made
            self.give_up(p, message, p.last_error or CRASH_ERROR)
            return 0
        try:
            record_attempt(self.db, self.lease(p), message, made + 1)
        except LeaseLost as exc:
            log.warning("%s", exc)
            self.book.drop(p)
            return 0
        except psycopg.Error as exc:
            log.warning("database: %s: %s", type(exc).__name__, redact(str(exc)))
            self.hold_for_database(p, message)
            return 0
        p.attempt_id, p.attempts, p.last_error = message.id, made + 1, CRASH_ERROR
        return self.apply(p, [message], recorded=True)

    def connected(self, p: Partition, message: InboxMessage) -> bool:
        assert self.db is not None
        db = usable(self.db, self.dsn)
        if db is None:
            self.hold_for_database(p, message)
            return False
        self.db = db
        return True

    def apply(self, p: Partition, messages: list[InboxMessage], recorded: bool = False) -> int:
        """Apply consecutive messages of ``p`` in one transaction; returns how many were applied or skipped.
        ``recorded``: the one message's attempt is already counted (``apply_alone``)."""
        if not self.connected(p, messages[0]):
            if recorded:
                p.attempts -= 1  # not the message's doing; the next record writes the count again
            return 0
        assert self.db is not None
        try:
            batch = apply_batch(self.db, self.lease(p), messages, self.handler, self.limit)
        except LeaseLost as exc:
            log.warning("%s", exc)
            self.book.drop(p)
            return 0
        except InboxStuck:
            raise
        except Exception as exc:
            # Nothing of the batch committed. A handler past its time limit: the messages before it
            # again, then its own failure; a database that went away: the first message waits.
            index = getattr(exc, "inbox_index", 0)
            if isinstance(exc, HandlerTimeout):
                done = self.apply(p, messages[:index]) if index else 0
                if p.tp in self.partitions and (p.held is None or p.held is messages[index]):
                    self.failed(p, messages[index], f"{type(exc).__name__}: {exc}", recorded)
                return done
            # The inbox's own statements failed (the database went away, a lock or statement timeout):
            # not the message's fault, so no attempt is counted; the first message waits.
            log.warning("database: %s: %s", type(exc).__name__, redact(str(exc)))
            if recorded:
                p.attempts -= 1
            self.hold_for_database(p, messages[0])
            return 0
        self.db_failures = 0
        done = len(batch.outcomes)
        if done:
            last = messages[done - 1]
            p.next_offset, p.last_message_id = last.offset + 1, last.id
            applied = batch.outcomes.count("applied")
            self.stats.applied += applied
            self.stats.duplicates += done - applied
            if p.attempt_id is not None and messages[0].id == p.attempt_id:
                p.attempt_id, p.attempts, p.last_error = None, 0, ""  # ``advance`` cleared the record too
            if p.held is not None:  # a retry that succeeded: read on after it
                p.held = None
                self.book.assign(p, last.offset + 1)
        if batch.failure is not None:
            error = batch.failure
            self.failed(p, messages[done], f"{type(error).__name__}: {error}", recorded)
        elif p.ramp != HEALTHY:
            p.ramp = next_probe_size(p.ramp, self.settings.batch_size)
        return done

    def hold_for_database(self, p: Partition, message: InboxMessage) -> None:
        self.db_failures += 1
        self.book.hold(p, message, DATABASE_BACKOFF.delay(self.db_failures))

    def failed(self, p: Partition, message: InboxMessage, error: str, recorded: bool = False) -> None:
        if p.attempt_id != message.id:
            p.attempt_id, p.attempts = message.id, 0
        if not recorded:
            p.attempts += 1
        elif self.db is not None and not self.db.closed and not self.db.broken:
            # The record says "the process stopped" until now: keep the real error for a later holder.
            try:
                record_failure(self.db, self.lease(p), message, error)
            except psycopg.Error as exc:
                log.debug("could not record the error of %s/%d@%d: %s", message.topic, message.partition,
                          message.offset, redact(str(exc)))
        p.last_error = error
        if p.attempts < self.settings.max_attempts:
            self.stats.retries += 1
            delay = self.backoff.delay(p.attempts)
            log.warning("handler failed on %s/%d@%d (id %s), attempt %d of %d, retry in %.1fs: %s", message.topic,
                        message.partition, message.offset, message.id, p.attempts, self.settings.max_attempts, delay,
                        error)
            self.book.hold(p, message, delay)
            return
        self.give_up(p, message, error)

    def give_up(self, p: Partition, message: InboxMessage, error: str) -> None:
        """Dead-letter the head message after its last attempt, and read the partition on after it."""
        assert self.db is not None
        self.db = usable(self.db, self.dsn) or self.db
        try:
            dead_letter(self.db, self.lease(p), message, p.attempts, error)
        except LeaseLost as exc:
            log.warning("%s", exc)
            self.book.drop(p)
            return
        except psycopg.OperationalError as exc:
            log.warning("database unavailable: %s", redact(str(exc)))
            self.hold_for_database(p, message)  # its next turn finds the attempts spent: dead-letters it
            return
        log.error("%s/%d@%d (id %s): %s failed: moved to the inbox's dead letters: %s", message.topic,
                  message.partition, message.offset, message.id, counted(p.attempts, "attempt"), error)
        self.stats.dead += 1
        if p.held is None:
            self.book.unassign(p)
        p.held, p.attempt_id, p.attempts, p.last_error = None, None, 0, ""
        p.next_offset, p.last_message_id = message.offset + 1, message.id
        # Messages after it may have been fetched with it and not applied: read on from right after it.
        self.book.assign(p, message.offset + 1)

    def retry_held(self) -> int:
        now = time.monotonic()
        handled = 0
        for p in list(self.partitions.values()):
            if p.held is not None and now >= p.retry_at and p.tp in self.partitions:
                handled += self.apply_next(p, [p.held])[1]
        return handled

    def retry_dead_letters(self) -> int:
        assert self.db is not None
        done, self.db = retry_dead_letters(self.db, self.dsn, self.settings, self.handler, self.limit)
        return done
