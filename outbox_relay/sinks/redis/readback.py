"""What the Redis sink's streams hold, read without consuming (``XRANGE``): for ``outbox-relay verify``
and the tests (the contract's ``received``)."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from ...errors import ConfigurationError
from .connection import check_url, connect, read_password

if TYPE_CHECKING:
    from ...redis_settings import RedisFields

PAGE = 1000  # entries per XRANGE
_GLOB = re.compile(r"([*?\[\]\\])")


def read_back(fields: RedisFields, *, topics: Collection[str] | None = None,
              timeout_seconds: float = 5.0) -> list[tuple[uuid.UUID, str, str]]:
    """(event id, partition key, stream) of every entry the sink's streams hold, in stream order per
    stream; entries that are not the sink's (no ``id`` UUID field) are left out. ``topics``: the streams
    of these topics only (prefix + topic); None: every stream whose name starts with the prefix."""
    if fields.redis_url is None:
        raise ConfigurationError("no Redis URL: pass --redis-url or set OUTBOX_REDIS_URL")
    target = check_url(fields.redis_url.get_secret_value())
    password = read_password(fields.redis_password_file) if fields.redis_password_file else None
    client = connect(target, password=password, timeout_seconds=timeout_seconds, max_connections=2,
                     ca_file=fields.redis_ca_file, client_cert=fields.redis_client_cert,
                     client_key=fields.redis_client_key, verify_tls=fields.redis_tls_verify)
    prefix = fields.redis_stream_prefix
    deadline = time.monotonic() + timeout_seconds
    try:
        if topics is not None:
            streams = [prefix + t for t in topics]
        else:
            pattern = _GLOB.sub(r"\\\1", prefix) + "*"
            streams = sorted(k.decode() for k in client.scan_iter(match=pattern, _type="stream", count=1000))
        out: list[tuple[uuid.UUID, str, str]] = []
        for stream in streams:
            out.extend(_entries(client, stream, deadline))
        return out
    finally:
        client.close()


def _entries(client: Any, stream: str, deadline: float) -> list[tuple[uuid.UUID, str, str]]:
    out: list[tuple[uuid.UUID, str, str]] = []
    start = "-"
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(f"reading stream {stream!r} took longer than the timeout")
        page = client.xrange(stream, min=start, max="+", count=PAGE)
        for _entry_id, fields in page:
            try:
                event_id = uuid.UUID(fields[b"id"].decode())
            except (KeyError, ValueError, UnicodeDecodeError):
                continue
            out.append((event_id, fields.get(b"subject", b"").decode(errors="replace"), stream))
        if len(page) < PAGE:
            return out
        start = "(" + page[-1][0].decode()


__all__ = ["read_back"]
