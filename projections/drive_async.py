"""The driver of a walk (walk.py) on an async connection, with an async handler: it runs the walk's
statements and handler calls and sends each outcome back. The one source: drive.py (sync connection,
sync handler) is generated from it by scripts/async_to_sync.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from outbox_relay.sinks.engine import Outcomes

from .walk import Execute, HandlerExited, OnCall, Reply, Walk, no_call_listener


async def adrive(steps: Walk, conn: psycopg.AsyncConnection[Any], handler: Callable[[Any, Any], Awaitable[Any]],
                 on_call: OnCall = no_call_listener) -> Outcomes:
    """Run a walk on a connection. A statement's error is sent back to the walk (which decides),
    unless the connection broke: then it is raised."""
    reply: Reply | None = None
    try:
        while True:
            step = steps.send(reply) if reply is not None else next(steps)
            error: Exception | None = None
            if isinstance(step, Execute):
                try:
                    await conn.execute(step.sql, step.params)
                except psycopg.Error as exc:
                    error = exc
            else:
                on_call(step.event)
                try:
                    await handler(step.argument, conn)
                except Exception as exc:
                    error = exc
                except (SystemExit, KeyboardInterrupt) as exc:
                    error = HandlerExited(exc)
                on_call(None)
            if error is not None and conn.broken:
                raise error
            reply = Reply(error, conn.info.transaction_status)
    except StopIteration as done:
        outcomes: Outcomes = done.value
        return outcomes
