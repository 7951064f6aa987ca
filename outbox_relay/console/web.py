"""What every page shares: the console's state (database pool, tokens, sessions), the templates, and
the sign-in and CSRF checks a handler asks for."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from jinja2 import Environment, FileSystemLoader, select_autoescape
from psycopg_pool import ConnectionPool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from ..admin.table import time_text
from ..dsn import redact
from .security import CSRF_COOKIE, CSRF_FIELD, SESSION_COOKIE, Session, Sessions, Token, csrf_ok, new_csrf, same_origin

HERE = Path(__file__).parent
# Autoescape on for every template (their names end in .html); nothing marks data |safe.
TEMPLATES = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True),
                        trim_blocks=True, lstrip_blocks=True)
TEMPLATES.filters["when"] = lambda v: time_text(v) if isinstance(v, datetime) else ("" if v is None else v)


@dataclass
class Console:
    """One console process: its pool, who may act (``tokens`` None: nobody, the console is read-only) and
    whether reading needs a session too (it listens beyond this host)."""

    pool: ConnectionPool[psycopg.Connection[Any]]
    dsn_shown: str
    tokens: list[Token] | None
    read_needs_token: bool
    max_attempts: int
    sessions: Sessions = field(default_factory=Sessions)

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        with self.pool.connection() as conn:
            yield conn


def console(request: Request) -> Console:
    c: Console = request.app.state.console
    return c


def session(request: Request) -> Session | None:
    return console(request).sessions.get(request.cookies.get(SESSION_COOKIE))


def render(request: Request, template: str, status: int = 200, **values: Any) -> HTMLResponse:
    """A page, with the CSRF value its forms carry (set as a cookie when the browser has none yet)."""
    token = request.cookies.get(CSRF_COOKIE) or new_csrf()
    c = console(request)
    body = TEMPLATES.get_template(template).render(
        csrf_field=CSRF_FIELD, csrf=token, signed_in=session(request), can_act=c.tokens is not None,
        database=c.dsn_shown, path=request.url.path, **values)
    response = HTMLResponse(body, status_code=status)
    if request.cookies.get(CSRF_COOKIE) != token:
        response.set_cookie(CSRF_COOKIE, token, httponly=True, samesite="strict", path="/")
    return response


def problem(request: Request, status: int, message: str) -> HTMLResponse:
    """An error page: what went wrong, in a sentence (secrets redacted)."""
    return render(request, "problem.html", status=status, message=redact(message))


def may_read(request: Request) -> Response | None:
    """None when the page may be shown; else where to go (sign in first, when listening beyond this host)."""
    if console(request).read_needs_token and session(request) is None:
        return RedirectResponse(f"/signin?next={request.url.path}", status_code=303)
    return None


async def checked_form(request: Request) -> tuple[dict[str, Any], Response | None]:
    """The POSTed form and None if it passes the CSRF check (and comes from our own origin); else a 403."""
    form = await request.form()
    values: dict[str, Any] = {k: form.getlist(k) if k == "event" else form.get(k) for k in form}
    field_value = values.get(CSRF_FIELD)
    if not same_origin(request.headers.get("origin"), request.headers.get("host"), request.url.scheme):
        return values, problem(request, 403, "refused: the form was sent from another site (Origin "
                               f"{request.headers.get('origin')!r})")
    if not csrf_ok(request.cookies.get(CSRF_COOKIE), field_value if isinstance(field_value, str) else None):
        return values, problem(request, 403, "refused: the form's CSRF token is missing or does not match "
                               "(reload the page and try again)")
    return values, None
