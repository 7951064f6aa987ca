"""An event's ledger (found by id), or a key's newest events: where each is in every sink."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .. import admin
from ..errors import OutboxError
from .web import console, may_read, problem, render

PAYLOAD_SHOWN = 64 * 1024  # characters of a payload's JSON on the page


def _pretty(value: object) -> str:
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= PAYLOAD_SHOWN else text[:PAYLOAD_SHOWN] + "\n... (cut)"


def events(request: Request) -> Response:
    """/events?id=... or /events?key=...; with neither, the search form."""
    if (go := may_read(request)) is not None:
        return go
    q = request.query_params
    event_id, key = (q.get("id") or "").strip(), q.get("key") or ""
    try:
        with console(request).connection() as conn:
            if event_id:
                one = admin.event_ledger(conn, event_id)
                if one is None:
                    return problem(request, 404, f"no stored event {event_id} (never published, or removed by "
                                                 "retention)")
                return render(request, "event.html", title=f"Event {event_id}", ledger=one,
                              payload=_pretty(one.event["payload"]), headers=_pretty(one.event["headers"]))
            found = admin.key_ledger(conn, key) if key else []
    except OutboxError as exc:
        return problem(request, 400, str(exc))
    return render(request, "events.html", title="Events", key=key, ledgers=found)


routes = [Route("/events", events, methods=["GET"])]
