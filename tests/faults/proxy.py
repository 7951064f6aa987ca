"""A TCP proxy that can cut or stall the connections through it: the network faults of the suite.

Each ``Proxy`` listens on a loopback port and forwards every connection to one upstream, a TCP
address or a unix socket (the embedded PostgreSQL listens only on a socket). It runs its own
asyncio loop in a daemon thread; the control methods are thread-safe:

- ``cut()`` aborts every current connection (both sides see a reset, as when a NAT or a
  firewall drops the flow); new connections are accepted as before.
- ``stall()`` stops forwarding in both directions: bytes stay where they are (the proxy holds at
  most one read per direction, the rest waits in the kernel's buffers under TCP back-pressure),
  new connections are accepted but not connected upstream. ``resume()`` lets everything flow on.

``exempt`` decides from a connection's first bytes that faults do not apply to it. The suite's
own Kafka clients (recorder, admin) set a ``client.id`` starting ``faults-``, and
``kafka_client_id`` reads it from the first request, so the observer is never a victim: the
broker advertises the proxy's port, so every client, the observer included, connects through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger("tests.faults.proxy")

T = TypeVar("T")

READ_SIZE = 65536
# How long a new connection may take to send its first bytes before it counts as not exempt.
FIRST_BYTES_TIMEOUT = 1.0


def kafka_client_id(first: bytes) -> str | None:
    """The ``client_id`` of a Kafka request (request header v1+: size, api key, version,
    correlation id, then a nullable int16-length string), or None if ``first`` is not one."""
    if len(first) < 14:
        return None
    (length,) = struct.unpack(">h", first[12:14])
    if length < 0 or len(first) < 14 + length:
        return None
    return first[14:14 + length].decode(errors="replace")


def exempt_kafka_clients(prefix: str) -> Callable[[bytes], bool]:
    """An ``exempt`` predicate for Kafka clients whose client.id starts with ``prefix``."""
    def exempt(first: bytes) -> bool:
        client_id = kafka_client_id(first)
        return client_id is not None and client_id.startswith(prefix)
    return exempt


@dataclass(eq=False)
class _Conn:
    exempt: bool
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    def abort(self) -> None:
        for w in self.writers:
            w.transport.abort()


@dataclass
class ProxyStats:
    accepted: int = 0
    cut: int = 0  # connections aborted by cut()
    upstream_failures: int = 0  # upstream refused or unreachable (the server is down)


class Proxy:
    """Forward ``127.0.0.1:port`` to ``upstream`` (``(host, port)`` or a unix socket path)."""

    def __init__(self, name: str, upstream: tuple[str, int] | str, *, port: int = 0,
                 exempt: Callable[[bytes], bool] | None = None) -> None:
        self.name = name
        self.upstream = upstream
        self.port = port
        self.exempt = exempt
        self.stats = ProxyStats()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._flowing: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"proxy-{name}", daemon=True)

    # -- control (any thread) -------------------------------------------------------------

    def start(self) -> Proxy:
        self._thread.start()
        self._call(self._listen())
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> int:
        """Abort every current connection that is not exempt; returns how many."""
        return self._call(self._cut())

    def stall(self) -> None:
        """Stop forwarding (connections that are not exempt) until ``resume()``."""
        self._call(self._set_flowing(False))

    def resume(self) -> None:
        self._call(self._set_flowing(True))

    def connections(self) -> int:
        return self._call(self._count())

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown(), timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- the loop -------------------------------------------------------------------------

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _cut(self) -> int:
        victims = [c for c in self._conns if not c.exempt]
        for c in victims:
            c.abort()
        self.stats.cut += len(victims)
        return len(victims)

    async def _set_flowing(self, flowing: bool) -> None:
        assert self._flowing is not None
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _count(self) -> int:
        return len(self._conns)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            c.abort()
        assert self._flowing is not None
        self._flowing.set()  # let held pumps run into their closed sockets and end

    async def _gate(self, conn: _Conn) -> None:
        if not conn.exempt:
            assert self._flowing is not None
            await self._flowing.wait()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        conn = _Conn(exempt=False, writers=[client_writer])
        self._conns.add(conn)
        try:
            first = b""
            if self.exempt is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    first = await asyncio.wait_for(client_reader.read(READ_SIZE), FIRST_BYTES_TIMEOUT)
                conn.exempt = bool(first) and self.exempt(first)
            await self._gate(conn)
            try:
                if isinstance(self.upstream, str):
                    up_reader, up_writer = await asyncio.open_unix_connection(self.upstream)
                else:
                    up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                self.stats.upstream_failures += 1
                return
            conn.writers.append(up_writer)
            if first:
                up_writer.write(first)
            await asyncio.gather(self._pump(client_reader, up_writer, conn),
                                 self._pump(up_reader, client_writer, conn))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.discard(conn)
            conn.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Conn) -> None:
        try:
            while True:
                data = await reader.read(READ_SIZE)
                if not data:
                    break
                await self._gate(conn)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            # One direction ended: end the whole connection (a half-open flow is of no use here).
            conn.abort()
