"""The operator console (``outbox-relay console``, extra ``console``): a small web application over
``outbox_relay.admin``: relays and sinks with the last hour's charts, a sink's waiting keys and dead
letters, an event's place in every sink, history, and confirmed, audited actions.

    from outbox_relay.console import create_app
    app = create_app(dsn, token_file="/run/secrets/console-tokens")  # any ASGI server runs it

Server-rendered, auto-escaped Jinja2 templates on Starlette; one small static script, no build step.
Pages: ``overview``, ``sink``, ``ledger`` (events), ``history``, ``audit``; ``actions`` (confirm, run,
audit); ``security`` (tokens, sessions, CSRF, headers); ``charts`` (SVG drawn here); ``web`` (shared).
"""

from .app import create_app

__all__ = ["create_app"]
