"""What the webhook sink makes of a receiver's answer: ``Retry-After``, and excerpts of what it said that are
safe to log (bounded, escaped, secrets masked)."""

from __future__ import annotations

import html
import json
import time
import urllib.parse
from collections.abc import Collection
from datetime import UTC
from email.utils import parsedate_to_datetime

from ...dsn import MASK, MIN_SECRET_CHARS, redact

MAX_RETRY_AFTER_SECONDS = 3600.0  # a longer Retry-After is cut to this (one key would wait for a day)
EXCERPT_CHARS = 300  # of a refusing response's body, in the dead letter's reason


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` as seconds from now (delay-seconds or an HTTP date), at most
    MAX_RETRY_AFTER_SECONDS; None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # str.isdigit() also takes '²' and other scripts' digits
        seconds = float(value)
    else:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # an HTTP date is GMT
            when = when.replace(tzinfo=UTC)
        seconds = when.timestamp() - (time.time() if now is None else now)
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)


def excerpt(body: bytes, limit: int = EXCERPT_CHARS, hide: Collection[str] = ()) -> str:
    """The start of a response body, safe for a log line or a dead letter: bounded, control characters
    and non-ASCII escaped, known secrets and the texts in ``hide`` masked (before the cut, so that no
    part of a secret is left at the end)."""
    text = redact(body.decode("utf-8", errors="replace"))
    for value in hide:  # longest first (query_secrets): a value inside another is masked with it
        text = text.replace(value, MASK)
    cut = len(text) > limit
    shown = json.dumps(text[:limit])[1:-1]  # escapes quotes, newlines, control and non-ASCII characters
    return redact(shown) + ("..." if cut else "")


def query_secrets(query: str) -> tuple[str, ...]:
    """What of a URL's query an answer may echo, longest first: the whole query as written, decoded
    and HTML-escaped (an HTML error page), and each value of MIN_SECRET_CHARS or more, as written and
    decoded (a shorter value would be masked inside ordinary words)."""
    if not query:
        return ()
    found = {query, urllib.parse.unquote(query), urllib.parse.unquote_plus(query), html.escape(query)}
    for pair in query.split("&"):
        value = pair.partition("=")[2]
        if len(value) >= MIN_SECRET_CHARS:
            found |= {value, urllib.parse.unquote(value), urllib.parse.unquote_plus(value)}
    return tuple(sorted((v for v in found if v), key=len, reverse=True))
