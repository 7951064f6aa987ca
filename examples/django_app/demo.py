"""The example Django app, end to end: migrate, then orders placed through the view.

    OUTBOX_DSN=postgresql://app@localhost/app python examples/django_app/demo.py   # your database
    python examples/django_app/demo.py                    # a private PostgreSQL (outbox-relay[embedded])

Needs ``pip install 'outbox-relay[django]'``. Only the producer side runs here: the events wait in
``outbox.events`` for an ``outbox-relay run`` process. As a server: ``python manage.py migrate``,
``python manage.py runserver``, then ``curl -d '{"customer": "alice", "total": 30}' localhost:8000/orders``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


@contextlib.contextmanager
def database() -> Iterator[str]:
    """OUTBOX_DSN if set, else an embedded PostgreSQL."""
    if os.environ.get("OUTBOX_DSN"):
        yield os.environ["OUTBOX_DSN"]
        return
    from outbox_relay.private_servers import EmbeddedPostgres

    with EmbeddedPostgres() as pg:
        yield pg.dsn


def main() -> int:
    with database() as dsn:
        os.environ["OUTBOX_DSN"] = dsn
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")
        import django
        from django.core.management import call_command
        from django.db import connection
        from django.test import Client

        django.setup()
        call_command("migrate", verbosity=0)  # the shop's tables, then the outbox schema (post_migrate)
        client = Client()
        for customer, total in [("alice", 30), ("bob", 900), ("bob", 200)]:  # bob's second is over his limit
            response = client.post("/orders", json.dumps({"customer": customer, "total": total}),
                                   content_type="application/json")
            print(f"POST /orders {customer} {total}: {response.status_code} {response.json()}")
        with connection.cursor() as cur:
            cur.execute("SELECT type, partition_key, payload FROM outbox.events ORDER BY xid, seq")
            events = cur.fetchall()
            cur.execute("SELECT count(*) FROM shop_order")
            (count,) = cur.fetchone()
        connection.close()
        print(f"orders stored: {count}; events stored: {len(events)} (the refused order left neither)")
        for event in events:
            print("  ", *event)
    return 0


if __name__ == "__main__":
    sys.exit(main())
