"""What keeps the console safe: the tokens (a file, as the webhook secret), signed-in sessions, the CSRF
check on every form, and the headers every response carries.

A token file holds one token a line, ``LABEL TOKEN`` or ``TOKEN`` alone (label ``token N``); blank lines
and ``#`` comments are skipped. A token is at least 16 characters. Signing in with one starts a session
(a random id in an HttpOnly, SameSite=Strict cookie, kept in this process's memory for ``SESSION_SECONDS``);
the audit names the session's operator (given at sign-in) or the token's label. Every POST carries the
double-submit CSRF token: a random value in its own cookie and in the form's hidden field, compared in
constant time, and a cross-site Origin is refused outright.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..dsn import remember_secret
from ..errors import ConfigurationError

SESSION_COOKIE = "outbox_console_session"
CSRF_COOKIE = "outbox_console_csrf"
CSRF_FIELD = "csrf"
SESSION_SECONDS = 8 * 3600.0
TOKEN_MIN_LENGTH = 16

# No inline script or style anywhere: the one script and the stylesheet are static files of this package.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'; object-src 'none'")
HEADERS = {
    "content-security-policy": CSP,
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    # same-origin, not no-referrer: with no-referrer Chromium sends "Origin: null" on our own form posts.
    "referrer-policy": "same-origin",
    "cross-origin-opener-policy": "same-origin",
}


@dataclass(frozen=True)
class Token:
    label: str
    value: str

    def __repr__(self) -> str:
        return f"Token({self.label!r}, '***')"


def load_tokens(path: str | Path) -> list[Token]:
    """The tokens of a token file (see the module's docstring); ConfigurationError names what is wrong."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read the console token file {str(path)!r}: "
                                 f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
    tokens: list[Token] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        label, _, value = line.rpartition(" ")
        label = label.strip() or f"token {len(tokens) + 1}"
        if len(value) < TOKEN_MIN_LENGTH:
            raise ConfigurationError(f"the console token file {str(path)!r}, line {number}: a token is at least "
                                     f"{TOKEN_MIN_LENGTH} characters (generate one: python -c \"import secrets; "
                                     "print(secrets.token_urlsafe(32))\")")
        remember_secret(value)  # never in a log or an error
        tokens.append(Token(label, value))
    if not tokens:
        raise ConfigurationError(f"the console token file {str(path)!r} holds no token")
    return tokens


def same(a: str, b: str) -> bool:
    """Constant-time comparison of two strings."""
    return hmac.compare_digest(a.encode(), b.encode())


def match_token(tokens: list[Token], given: str) -> Token | None:
    """The token ``given`` is, comparing with every one in constant time (no early exit on a match)."""
    found = None
    for t in tokens:
        if same(t.value, given):
            found = t
    return found


@dataclass(frozen=True)
class Session:
    label: str
    operator: str | None
    expires: float

    @property
    def who(self) -> str:
        return f"{self.operator} (token {self.label})" if self.operator else self.label


class Sessions:
    """Signed-in sessions of this process (a restart signs everyone out)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Session] = {}  # guarded by _lock: request threads sign in and out

    def start(self, token: Token, operator: str | None) -> str:
        sid = secrets.token_urlsafe(32)
        with self._lock:
            now = time.monotonic()
            self._by_id = {k: s for k, s in self._by_id.items() if s.expires > now}
            self._by_id[sid] = Session(token.label, operator, now + SESSION_SECONDS)
        return sid

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        with self._lock:
            s = self._by_id.get(sid)
        return s if s is not None and s.expires > time.monotonic() else None

    def end(self, sid: str | None) -> None:
        with self._lock:
            self._by_id.pop(sid or "", None)


def new_csrf() -> str:
    return secrets.token_urlsafe(32)


def csrf_ok(cookie: str | None, field: str | None) -> bool:
    """The double-submit check: the form's value equals the cookie's (constant time), both present."""
    return bool(cookie) and bool(field) and same(cookie or "", field or "")


def same_origin(origin: str | None, host: str | None, scheme: str) -> bool:
    """A POST from this console's own pages: no Origin header (older clients), or ours."""
    return origin is None or origin == f"{scheme}://{host}"


class SecurityHeaders:
    """ASGI middleware: the headers above on every response, and no-store on everything but the static files
    (pages carry data an operator should not find in a shared cache or the back button's history)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = str(scope.get("path", "")).startswith("/static/")

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    headers[name] = value
                headers["cache-control"] = "public, max-age=300" if static else "no-store"
            await send(message)

        await self.app(scope, receive, with_headers)
