"""A sink: its backlog, the keys that wait and why (the words of ``keys show``), paused keys, and its dead
letters with a key filter and paging."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .. import admin
from ..errors import OutboxError
from .web import console, may_read, problem, render

PAGE = 50


def _after_key(value: str | None) -> tuple[int, str] | None:
    """``bucket:key`` (the last key of the previous page)."""
    if not value:
        return None
    bucket, _, key = value.partition(":")
    return (int(bucket), key) if bucket.isdigit() and key else None


def sink_page(request: Request) -> Response:
    if (go := may_read(request)) is not None:
        return go
    name = request.path_params["sink"]
    q = request.query_params
    key = q.get("key") or None
    c = console(request)
    try:
        with c.connection() as conn:
            found = admin.backlog(conn, name)[0]
            waiting = admin.waiting_keys(conn, name, limit=PAGE, after=_after_key(q.get("after_key")),
                                         max_attempts=c.max_attempts)
            paused = admin.paused_keys(conn, name).records()
            letters = admin.dead_letters(conn, sink=name, key=key, limit=PAGE, after=q.get("after") or None)
    except OutboxError as exc:
        return problem(request, 404, str(exc))
    return render(request, "sink.html", title=f"Sink {name}", sink=found, waiting=waiting, paused=paused,
                  letters=letters.records(), more_letters=letters.more, last_letter=letters.last_event_id,
                  key=key, max_attempts=c.max_attempts)


routes = [Route("/sinks/{sink}", sink_page, methods=["GET"])]
