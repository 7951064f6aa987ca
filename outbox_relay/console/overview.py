"""The overview: relays (alive, draining, silent, buckets held), sinks (backlog, oldest, retrying, paused,
dead letters, delivered per second) and the last hour's charts."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .. import admin
from .charts import delivered_rates, overview_charts, per_sink, sparkline
from .web import console, may_read, render


def _relay_state(r: dict[str, Any]) -> str:
    """alive, draining, dead, or silent (alive in the registry but not heard from within its TTL: stuck or gone)."""
    ttl = r["ttl_seconds"] or admin.DEFAULT_WORKER_TTL_SECONDS
    if r["status"] == "alive" and r["seen_seconds_ago"] is not None and float(r["seen_seconds_ago"]) > ttl:
        return "silent"
    return str(r["status"])


def overview(request: Request) -> Response:
    if (go := may_read(request)) is not None:
        return go
    with console(request).connection() as conn:
        relays = admin.relays(conn).records()
        sinks = admin.backlog(conn)
        samples = admin.samples_since(conn, 61)
        rebuilds = admin.rebuilds(conn).records()
    for r in relays:
        r["state"] = _relay_state(r)
        r["held"] = sum(int(n) for n in (r["buckets"] or {}).values())
    by = per_sink(samples)
    rates = {s: rs[-1][1] for s, v in by.items() if (rs := delivered_rates(v))}
    return render(request, "overview.html", title="Overview", relays=relays, sinks=sinks, rates=rates,
                  sparks={s: sparkline(v) for s, v in by.items()}, charts=overview_charts(samples),
                  rebuilds=rebuilds)


routes = [Route("/", overview, methods=["GET"])]
