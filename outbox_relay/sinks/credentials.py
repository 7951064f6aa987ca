"""The broker sinks' credentials (NATS, Redis, RabbitMQ): a password or token in a URL, or in a file, each
remembered for ``dsn.redact`` before anything can fail and show it, so no log line, reason or error holds it."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from ..dsn import remember_secret
from ..errors import ConfigurationError


def remember_url_secret(secret: str | None) -> None:
    """A URL's password (or token), masked as written in the URL and percent-decoded."""
    if secret:
        remember_secret(secret)
        remember_secret(urllib.parse.unquote(secret))


def read_secret_file(path: Path, what: str, *, empty_ok: bool = False) -> str:
    """The secret in ``path`` (one trailing newline dropped), remembered for redaction; ConfigurationError
    naming ``what`` (``the Redis password file``) and the file, never its content, when it can not be read
    or (unless ``empty_ok``) is empty."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read {what} {str(path)!r}: "
                                 f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
    secret = text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")
    if not secret and not empty_ok:
        raise ConfigurationError(f"{what} {str(path)!r} is empty")
    remember_secret(secret)
    return secret
