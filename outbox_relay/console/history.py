"""History: retention classes, partitions and what each holds (and what holds it), rebuilds in progress
with their progress, and each projection's stored history."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .. import admin
from .web import console, may_read, render


def history(request: Request) -> Response:
    if (go := may_read(request)) is not None:
        return go
    with console(request).connection() as conn:
        retention = admin.retention(conn)
        partitions = admin.history_partitions(conn).records()
        rebuilds = admin.rebuilds(conn).records()
        projections = admin.projection_history(conn).records()
    return render(request, "history.html", title="History", classes=retention.classes.records(),
                  by_class=retention.history.records(), partitions=partitions, rebuilds=rebuilds,
                  projections=projections)


routes = [Route("/history", history, methods=["GET"])]
