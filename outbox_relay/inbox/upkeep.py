"""The inbox's periodic work beside applying messages: dead letters an operator asked to retry, and
retention of the dedupe records. Each pass owns nothing between calls: the connection is the caller's."""

from __future__ import annotations

import logging
from contextlib import suppress
from typing import Any

import psycopg

from ..dsn import redact
from ..sqlfiles import query
from .settings import InboxSettings
from .store import Handler, HandlerTimeout, InboxStuck, TimeLimit, retry_one_dead_letter

log = logging.getLogger("outbox_relay.inbox")

MAX_RETENTION_BATCHES = 100  # per housekeeping pass; the next pass goes on
MAX_DEAD_LETTER_RETRIES = 100  # per pass


def try_connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any] | None:
    try:
        return psycopg.connect(dsn, connect_timeout=5, **kwargs)
    except psycopg.OperationalError as exc:
        log.warning("database unavailable: %s", redact(str(exc)))
        return None


def usable(db: psycopg.Connection[Any], dsn: str) -> psycopg.Connection[Any] | None:
    """``db``, or a new connection if it closed or broke; None while the database is unreachable."""
    return try_connect(dsn) if db.closed or db.broken else db


def retry_dead_letters(db: psycopg.Connection[Any], dsn: str, settings: InboxSettings, handler: Handler,
                       limit: TimeLimit) -> tuple[int, psycopg.Connection[Any]]:
    """Apply the dead letters marked for retry, a bounded number per pass: (how many were applied, skipped
    or gone; the connection to go on with: a new one if ``db`` broke or a handler timed out)."""
    reconnected = usable(db, dsn)
    if reconnected is None:
        return 0, db
    db, done = reconnected, 0
    try:
        for _ in range(MAX_DEAD_LETTER_RETRIES):
            result = retry_one_dead_letter(db, settings.consumer, handler, limit)
            if result is None:
                break
            ident, outcome = result
            if outcome in ("applied", "duplicate", "gone"):
                log.info("dead letter %d retried: %s", ident, outcome)
                done += 1
            else:
                log.warning("dead letter %d failed again: %s", ident, outcome)
    except InboxStuck:
        raise
    except HandlerTimeout as exc:
        timed_out = getattr(exc, "dead_letter_id", None)
        log.warning("dead letter %s failed again: %s", timed_out, exc)
        db = try_connect(dsn) or db
        if timed_out is not None and not db.closed:
            with suppress(psycopg.Error), db.transaction():
                db.execute(query("inbox", "retry_failed"), {"id": timed_out, "error": f"HandlerTimeout: {exc}"})
    except psycopg.OperationalError as exc:
        log.warning("retrying dead letters: %s", redact(str(exc)))
    return done, db


def housekeeping(control: psycopg.Connection[Any], settings: InboxSettings) -> int:
    """Forget stale members and delete dedupe records past retention, a bounded batch per transaction;
    returns how many records."""
    s = settings
    deleted = 0
    try:
        control.execute(query("inbox", "delete_stale_members"), {"consumer": s.consumer, "ttl": s.lease_seconds})
        for _ in range(MAX_RETENTION_BATCHES):
            n = control.execute(query("inbox", "delete_old_messages"), {
                "consumer": s.consumer, "retention": s.retention_seconds, "batch": s.retention_batch}).rowcount
            deleted += n
            if n < s.retention_batch:
                break
    except psycopg.Error as exc:
        log.warning("inbox housekeeping: %s", redact(str(exc)))
    if deleted:
        log.info("retention: deleted %d dedupe records older than %gs", deleted, s.retention_seconds)
    return deleted
