"""The NATS sink's connection: the URL's checks, credentials and TLS, and one client per event loop.

The client library (nats-py) is imported here, lazily: ``import outbox_relay`` never needs it. A connection
the client gave up on (closed) or made on another event loop is replaced on the next call; while the client
is reconnecting nothing is published (``pending_size=0``: no buffering of messages whose acknowledgement
nobody would wait for), so each call says the sink is unavailable instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...dsn import describe_error, remember_secret
from ...errors import ConfigurationError
from ..credentials import read_secret_file, remember_url_secret
from ..user import SinkUnavailable
from .acks import Acks

if TYPE_CHECKING:
    from nats.aio.client import Client

log = logging.getLogger("outbox_relay.nats")

SCHEMES = ("nats", "tls")
RECONNECT_WAIT_SECONDS = 0.5  # between the client's reconnect attempts
RECONNECT_ATTEMPTS = 2  # per server; then the client closes and the next call connects anew


def client_library() -> Any:
    """The ``nats`` module, or ConfigurationError saying which extra to install."""
    try:
        import nats
    except ImportError:
        raise ConfigurationError("the nats sink needs `pip install outbox-relay[nats]` (nats-py)") from None
    return nats


def check_url(url: str) -> list[str]:
    """The server URLs of ``url`` (comma-separated ``nats://`` or ``tls://``), or ConfigurationError naming what
    is wrong (never quoting a URL: it may hold a password or token, which are remembered for redaction)."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ConfigurationError("the NATS URL is empty")
    for n, server in enumerate(servers, 1):
        where = f"the NATS URL{f' (server {n})' if len(servers) > 1 else ''}"
        try:
            parts = urllib.parse.urlsplit(server)
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as exc:
            raise ConfigurationError(f"{where} is not a URL: {exc}") from None
        # nats://token@host or nats://user:password@host
        remember_url_secret(parts.password if parts.password is not None else parts.username)
        if parts.scheme not in SCHEMES:
            raise ConfigurationError(f"{where} must start with nats:// or tls://")
        if not parts.hostname:
            raise ConfigurationError(f"{where} has no host")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ConfigurationError(f"{where} must be scheme://[user:password@]host[:port], with no path or query")
        if any(c.isspace() for c in server):
            raise ConfigurationError(f"{where} holds whitespace")
    return servers


def endpoint(servers: list[str]) -> str:
    """The servers as logs show them: no user info."""
    shown = []
    for server in servers:
        parts = urllib.parse.urlsplit(server)
        shown.append(f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}")
    return ",".join(shown)


def read_secret(path: Path, what: str) -> str:
    """A secret from a file (one trailing newline dropped), remembered for redaction."""
    return read_secret_file(path, f"the NATS {what} file", empty_ok=True)


@dataclass(frozen=True)
class ConnectOptions:
    """How to reach and authenticate to the servers. ``repr`` shows no secret."""

    servers: list[str] = field(repr=False)  # a URL may hold a password or token
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds_file: Path | None = None  # a .creds file: user JWT and nkey seed
    nkey_seed_file: Path | None = None
    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    tls_verify: bool = True
    connect_timeout_seconds: float = 5.0

    def __post_init__(self) -> None:
        for secret in (self.password, self.token):
            if secret:
                remember_secret(secret)
        if self.client_key is not None and self.client_cert is None:
            raise ConfigurationError("a NATS client key needs its client certificate")
        if self.password is not None and self.user is None:
            raise ConfigurationError("a NATS password needs a user (--nats-user)")

    def tls(self) -> ssl.SSLContext | None:
        wanted = (self.ca_file or self.client_cert or not self.tls_verify
                  or any(s.startswith("tls://") for s in self.servers))
        if not wanted:
            return None
        try:
            context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
            if self.client_cert is not None:
                context.load_cert_chain(str(self.client_cert), str(self.client_key) if self.client_key else None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(f"NATS TLS files are not usable: {type(exc).__name__}: "
                                     f"{getattr(exc, 'strerror', None) or exc}") from None
        if not self.tls_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    def arguments(self) -> dict[str, Any]:
        """Keyword arguments of ``nats.connect`` (credentials, TLS, timeouts, reconnects)."""
        args: dict[str, Any] = {
            "servers": self.servers, "connect_timeout": self.connect_timeout_seconds,
            "reconnect_time_wait": RECONNECT_WAIT_SECONDS, "max_reconnect_attempts": RECONNECT_ATTEMPTS,
            "pending_size": 0, "allow_reconnect": True,
        }
        if self.user is not None:
            args["user"] = self.user
        if self.password is not None:
            args["password"] = self.password
        if self.token is not None:
            args["token"] = self.token
        if self.creds_file is not None:
            args["user_credentials"] = str(self.creds_file)
        if self.nkey_seed_file is not None:
            args["nkeys_seed"] = str(self.nkey_seed_file)
        context = self.tls()
        if context is not None:
            args["tls"] = context
        return args


class Connection:
    """One NATS client and its PubAck subscription (``Acks``), made on the event loop of the first call that
    needs it.
    Only touched on that loop, but for ``close`` (any thread)."""

    def __init__(self, options: ConnectOptions, sink: str) -> None:
        self.options = options
        self.sink = sink  # for log lines
        self.endpoint = endpoint(options.servers)
        self.last_error: str | None = None  # the last asynchronous error (e.g. a permission, a reset socket)
        # ... and the last one the server itself sent, since this connect began: a refused login is followed by
        # the socket the server then closes, and the reason must name the login, not the reset.
        self.server_said: str | None = None
        self._nc: Client | None = None
        self._acks: Acks | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._closing = False  # close() was called: a disconnect is no news
        client_library()  # a missing extra is a configuration error at start-up, not a failure per event

    async def acks(self) -> Acks:
        """The publisher of a connected client; SinkUnavailable if there is none now."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            await self._drop()
            self._loop, self._lock = loop, asyncio.Lock()
        assert self._lock is not None
        async with self._lock:
            if self._nc is not None and self._nc.is_closed:
                self._nc = self._acks = None
            if self._nc is None:
                await self._connect()
        nc, acks = self._nc, self._acks
        assert nc is not None and acks is not None
        if not nc.is_connected:
            raise SinkUnavailable(f"nats {self.endpoint}: not connected (reconnecting)", RECONNECT_WAIT_SECONDS * 2)
        return acks

    def max_payload(self) -> int:
        """The largest message (headers and payload) the connected server takes, from its INFO."""
        assert self._nc is not None
        return int(self._nc.max_payload)

    async def _connect(self) -> None:
        nats = client_library()
        nc = nats.aio.client.Client()
        self.server_said = None
        try:
            # The client retries each server RECONNECT_ATTEMPTS times; the wait bounds a server that never answers.
            await asyncio.wait_for(
                nc.connect(**self.options.arguments(), error_cb=self._error, disconnected_cb=self._disconnected,
                           reconnected_cb=self._reconnected, name=f"outbox-relay {self.sink}"),
                self.options.connect_timeout_seconds * (RECONNECT_ATTEMPTS + 1) + RECONNECT_WAIT_SECONDS * 2)
            acks = await Acks(nc).start()
        except BaseException as exc:
            # Half made (a timeout, or the call abandoned and cancelled): its socket is closed here, not left to
            # the garbage collector.
            await self._close(nc)
            if not isinstance(exc, Exception):
                raise
            raise SinkUnavailable(f"nats {self.endpoint}: can not connect: {self._why(exc)}", 1.0) from None
        self._nc, self._acks = nc, acks
        log.info("nats sink %s: connected to %s", self.sink, self.endpoint)

    def _why(self, exc: BaseException) -> str:
        if isinstance(exc, asyncio.TimeoutError):
            return "timed out"
        text = describe_error(exc)
        if self.server_said and self.server_said not in text:
            text += f" (the server said: {self.server_said})"
        if self.last_error and self.last_error not in text:
            text += f" (last error: {self.last_error})"
        return text

    async def _error(self, exc: Exception) -> None:
        self.last_error = describe_error(exc)
        if not isinstance(exc, OSError):  # the server's word (-ERR), not the transport's
            self.server_said = self.last_error
        log.debug("nats sink %s: %s", self.sink, self.last_error)

    async def _disconnected(self) -> None:
        if self._closing:
            return
        log.warning("nats sink %s: disconnected from %s; its events wait while the client reconnects", self.sink,
                    self.endpoint)

    async def _reconnected(self) -> None:
        log.info("nats sink %s: reconnected to %s", self.sink, self.endpoint)

    async def _drop(self) -> None:
        nc, self._nc, self._acks = self._nc, None, None
        if nc is not None and not nc.is_closed:
            await self._close(nc)

    async def _close(self, nc: Client) -> None:
        """Close a client of ours, its disconnect no news (``_closing``), whatever the close raises."""
        self._closing = True
        try:
            with contextlib.suppress(Exception):
                await nc.close()
        finally:
            self._closing = False

    def close(self, timeout: float = 5.0) -> None:
        """Close the client from any thread (on its loop, if that still runs)."""
        nc, loop = self._nc, self._loop
        if nc is None or loop is None or loop.is_closed() or nc.is_closed:
            self._nc = self._acks = None
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:  # on the loop itself: schedule it
            loop.create_task(self._drop())
        elif loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._drop(), loop).result(timeout)
        else:
            with contextlib.suppress(Exception):
                loop.run_until_complete(self._drop())


__all__ = ["ConnectOptions", "Connection", "check_url", "client_library", "endpoint", "read_secret"]
