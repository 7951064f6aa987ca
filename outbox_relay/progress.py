# WARNING: generated from outbox_relay/progress_async.py by scripts/async_to_sync.py: edit the source, then run
# `python scripts/async_to_sync.py --write`.
"""Read-your-writes: wait until events have been applied by a sink (published to Kafka, or projected).

An API that published an event and must answer with state the event produces (a read model a
projection maintains), or a test that checks what reached Kafka, calls ``wait_for`` after its
transaction committed. Each poll is one statement (``event_progress`` in sql/queries/progress.sql)
that probes primary keys only, so polling is cheap however long the log is.

Every poll runs in its own short transaction, never one transaction across the wait:

- the events of the caller's own open transaction are invisible to the relays until it commits:
  the wait could only end in a timeout. That is why a connection inside a transaction is refused
  (a read-only one too, for the next two reasons).
- a snapshot kept across polls (REPEATABLE READ) would never see the cursors move;
- an open snapshot, even read-only, keeps vacuum from pruning the cursor rows the relays update
  once per batch, so they bloat for as long as the wait lasts.

The decisions (which events are still waiting, what to raise, how long to sleep) live in
``Wait`` (wait_plan.py); the two drivers only run the query and sleep. This is
progress_async.py, the one source: progress.py is generated from it (scripts/async_to_sync.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from .sqlfiles import query
from .wait_plan import DEFAULT_POLL, EventRef, Poll, Wait, check_idle


def wait_for(conn: psycopg.Connection[Any], event_ids: EventRef | Iterable[EventRef],
             sink: str = "kafka", timeout: float = 10.0, poll: Poll = DEFAULT_POLL) -> None:
    """Return once ``sink`` has applied every given event (their transaction must have committed).

    Applied means the sink's cursor is past the event and it is neither parked nor dead-lettered: it was
    published (Kafka acknowledged it) or projected, or the sink does not take it (a projection that
    subscribes to other event types). An event of a key paused for the sink (``outbox-relay keys
    pause``) waits until the key is resumed; a timeout reports it as paused and names the pause.

    ``event_ids``: one id or ``Published`` (what ``Outbox.publish`` returns), or an iterable of them.
    ``conn`` must not be inside a transaction (``OpenTransaction``); each poll is its own
    transaction (autocommit, or committed at once). Raises ``EventDeadLettered`` as soon as one of the
    events was given up on, ``UnknownEvent`` for ids with no stored event, ``ConfigurationError``
    for a sink that was never registered, ``WaitTimeout`` after ``timeout`` seconds.
    """
    check_idle(conn.info.transaction_status)
    wait = Wait(event_ids, sink, timeout, poll)
    sql = query("progress", "event_progress")
    while True:
        with conn.cursor(row_factory=tuple_row) as cur:
            if conn.autocommit:
                cur.execute(sql, wait.params())
                rows = cur.fetchall()
            else:
                with conn.transaction():
                    cur.execute(sql, wait.params())
                    rows = cur.fetchall()
        delay = wait.step(rows)
        if delay is None:
            return
        time.sleep(delay)
