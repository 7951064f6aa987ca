"""The audit page: every action taken in the console, newest first."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .. import admin
from .web import console, may_read, render

PAGE = 100


def audit(request: Request) -> Response:
    if (go := may_read(request)) is not None:
        return go
    before = request.query_params.get("before")
    with console(request).connection() as conn:
        page = admin.audit_log(conn, limit=PAGE, before=int(before) if before and before.isdigit() else None)
    records = page.records()
    return render(request, "audit.html", title="Audit", records=records,
                  next_before=records[-1]["id"] if len(records) == PAGE else None)


routes = [Route("/audit", audit, methods=["GET"])]
