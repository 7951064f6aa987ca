"""Why a NATS connect failed, as the parked event's reason says it (outbox_relay/sinks/nats/connection.py)."""

from __future__ import annotations

import asyncio

import nats.errors

from outbox_relay.sinks.nats.connection import Connection, ConnectOptions


def test_a_refused_login_is_named_even_when_a_reset_socket_came_after_it() -> None:
    """The server answers a wrong password with -ERR 'Authorization Violation' and closes the socket: on a busy
    machine the client reports the reset last. The reason names the login (seen in CI with a CPU hog)."""
    conn = Connection(ConnectOptions(servers=["nats://127.0.0.1:4222"]), "nats")

    async def errors() -> None:
        await conn._error(nats.errors.AuthorizationError())
        await conn._error(ConnectionResetError(104, "Connection reset by peer"))

    asyncio.run(errors())
    reason = conn._why(nats.errors.NoServersError())
    assert "Authorization" in reason and "Connection reset" in reason, reason
