"""The Redis sink's client: the URL's checks, credentials (in the URL or a file), TLS, and which of the
server's answers are conditions of the sink rather than faults of an event.

``redis`` (redis-py) is imported here, lazily: ``import outbox_relay`` never needs it.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ConfigurationError
from ..credentials import read_secret_file, remember_url_secret

if TYPE_CHECKING:
    import redis

SCHEMES = ("redis", "rediss", "unix")
INSTALL = "the redis sink needs `pip install outbox-relay[redis]`"
# The first word of a server error that says the server (or this relay's access to it) can not take
# writes now, whatever the event: its events wait, no attempt counted, nothing dead-lettered.
CONDITION_CODES = frozenset({
    "NOAUTH", "WRONGPASS", "NOPERM",  # credentials, ACLs
    "OOM", "MISCONF", "READONLY", "LOADING", "BUSY", "MASTERDOWN", "NOREPLICAS",  # the server's state
    "CLUSTERDOWN", "TRYAGAIN", "MOVED", "ASK", "CROSSSLOT",  # a cluster (this sink speaks to one node)
    "WRONGTYPE",  # the stream's key holds another type: a misconfigured destination
})


def redis_module() -> Any:
    """The ``redis`` package, or ConfigurationError saying how to install it."""
    try:
        import redis
    except ImportError:
        raise ConfigurationError(INSTALL) from None
    return redis


@dataclass(frozen=True)
class Target:
    """A checked URL: what the client is given, and what logs and reasons may show (no credentials)."""

    url: str
    endpoint: str
    tls: bool
    password: str | None


def check_url(url: str) -> Target:
    """The URL's parts, or ConfigurationError saying what is wrong (never quoting it: it may hold a
    password). Its password is remembered for redaction first."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ConfigurationError(f"the Redis URL is not a URL: {exc}") from None
    password = urllib.parse.unquote(parts.password) if parts.password else None
    remember_url_secret(parts.password)
    if parts.scheme not in SCHEMES:
        raise ConfigurationError("the Redis URL must start with redis://, rediss:// (TLS) or unix://")
    if parts.scheme != "unix" and not parts.hostname:
        raise ConfigurationError("the Redis URL has no host")
    if parts.scheme == "unix" and not parts.path:
        raise ConfigurationError("the Redis URL unix:// has no socket path")
    if parts.fragment or any(c in url.strip() for c in " \r\n\t"):
        raise ConfigurationError("the Redis URL holds whitespace or a #fragment")
    if parts.scheme != "unix" and parts.path not in ("", "/") and not parts.path.lstrip("/").isdigit():
        raise ConfigurationError("the Redis URL's path must be a database number (redis://host:6379/0)")
    host = parts.hostname or ""
    where = f"unix://{parts.path}" if parts.scheme == "unix" else f"{parts.scheme}://{host}:{parts.port or 6379}"
    database = parts.path.lstrip("/") if parts.scheme != "unix" else ""
    return Target(url.strip(), where + (f"/{database}" if database else ""), parts.scheme == "rediss", password)


def read_password(path: Path) -> str:
    """A password file's content (one trailing newline dropped), remembered for redaction."""
    return read_secret_file(path, "the Redis password file")


def connect(target: Target, *, password: str | None, timeout_seconds: float, max_connections: int,
            ca_file: Path | None = None, client_cert: Path | None = None, client_key: Path | None = None,
            verify_tls: bool = True) -> redis.Redis:
    """A client for ``target`` (connections made on first use, one per delivering thread at a time).

    One retry, on a connection error only: a pooled connection the server closed while idle (after a
    restart) fails its first command; the command is sent once more on a new one. A timeout is never
    retried here: the relay decides (the entry may have landed; the consumer dedupes by ``id``)."""
    lib = redis_module()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    if not target.tls and (ca_file or client_cert or client_key or not verify_tls):
        raise ConfigurationError("Redis TLS settings (CA file, client certificate, verify off) need a rediss:// URL")
    if client_key is not None and client_cert is None:
        raise ConfigurationError("a Redis client key needs its client certificate (--redis-client-cert)")
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout_seconds, "socket_connect_timeout": timeout_seconds,
        "retry": Retry(NoBackoff(), 1, supported_errors=(lib.exceptions.ConnectionError,)),
        "max_connections": max_connections, "client_name": "outbox-relay",
    }
    if password is not None:
        kwargs["password"] = password
    if target.tls:
        for path in (ca_file, client_cert, client_key):
            if path is not None and not path.is_file():
                raise ConfigurationError(f"Redis TLS file {str(path)!r} does not exist")
        kwargs.update({"ssl_ca_certs": str(ca_file) if ca_file else None,
                       "ssl_certfile": str(client_cert) if client_cert else None,
                       "ssl_keyfile": str(client_key) if client_key else None,
                       "ssl_cert_reqs": "required" if verify_tls else "none", "ssl_check_hostname": verify_tls})
    try:
        client: redis.Redis = lib.Redis.from_url(target.url, **kwargs)
    except ValueError as exc:  # redis-py's own URL checks (they quote no password)
        raise ConfigurationError(f"the Redis URL is not usable: {exc}") from None
    return client


def condition(exc: BaseException) -> str | None:
    """Why ``exc`` (an error of redis-py) is a condition of the sink, or None if it is not one."""
    lib = redis_module()
    if isinstance(exc, lib.exceptions.ConnectionError | lib.exceptions.TimeoutError):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, lib.exceptions.ResponseError):
        code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
        if code in CONDITION_CODES or str(exc).startswith("unknown command"):
            return f"{code} {exc}" if not str(exc).startswith(code) else str(exc)
    return None


__all__ = ["CONDITION_CODES", "INSTALL", "Target", "check_url", "condition", "connect", "read_password",
           "redis_module"]
