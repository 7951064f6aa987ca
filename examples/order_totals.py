"""A read model kept by the relay, read-your-writes, and a rebuild while orders keep coming.

    python examples/order_totals.py       # embedded PostgreSQL; after `bash scripts/demo.sh` made .venv:
                                          # .venv/bin/python examples/order_totals.py

1. Starts a private PostgreSQL 18 (from a wheel; no Kafka needed here), migrates, creates the
   order service's table and the read model's tables (examples/read_models.py).
2. Starts one `outbox-relay run --no-kafka --projection order_totals` process.
3. Places and pays 40 orders (examples/order_service.py), then waits until the read model has
   applied the last one (`wait_for`: read-your-writes) and prints it.
4. Runs `outbox-relay rebuild order_totals` while another 40 orders are being placed: the rebuild
   replays history into fresh tables, then swaps them in with the live projection's position.
5. Checks that the read model equals the same totals computed straight from the orders table,
   then stops the relay (SIGTERM: it drains and exits 0).

Exit status 0 when the read model matches the orders table, before and after the rebuild.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))  # order_service and read_models, next to this file

from order_service import create_schema, pay_order, place_order
from read_models import SCHEMA

from outbox_relay import migrate, wait_for
from outbox_relay.private_servers import EmbeddedPostgres

HERE = Path(__file__).resolve().parent
PROJECTION = ["--projections", "read_models"]
RELAY_OPTIONS = ["--no-kafka", *PROJECTION, "--projection", "order_totals", "--heartbeat-seconds", "0.5",
                 "--worker-ttl-seconds", "2", "--poll-seconds", "0.2", "--drain-seconds", "10"]

# The same numbers, from the source of truth: what the read model must say.
FROM_ORDERS = """
SELECT customer, count(*)::int, sum(amount), coalesce(sum(amount) FILTER (WHERE status = 'paid'), 0)
FROM orders GROUP BY customer ORDER BY customer
"""
READ_MODEL = "SELECT customer, orders, placed, paid FROM order_totals ORDER BY customer"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "outbox_relay.cli", *args]


def business(dsn: str, first: int, count: int, seed: int) -> list[Any]:
    """Place ``count`` orders and pay about two thirds of them; returns the published events."""
    rnd = random.Random(seed)
    published = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for order_id in range(first, first + count):
            customer = f"customer-{rnd.randint(1, 6)}"
            published.append(place_order(conn, order_id, customer, Decimal(rnd.randint(500, 9000)) / 100))
            if rnd.random() < 0.66:
                published.append(pay_order(conn, order_id, f"pay-{order_id}"))
    return published


def show(title: str, rows: list[tuple[Any, ...]]) -> None:
    print(f"\n{title}")
    print(f"  {'customer':<12} {'orders':>6} {'placed':>10} {'paid':>10}")
    for customer, orders, placed, paid in rows:
        print(f"  {customer:<12} {orders:>6} {placed:>10.2f} {paid:>10.2f}")


def main() -> int:
    with EmbeddedPostgres() as pg:
        dsn = pg.dsn
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_schema(conn)
            conn.execute(SCHEMA)
        env = {**os.environ, "OUTBOX_DSN": dsn, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get(
            "PYTHONPATH", "")]).rstrip(os.pathsep)}
        relay = subprocess.Popen(cli("--log-level", "warning", "run", "--worker-id", "totals-relay",
                                     *RELAY_OPTIONS), env=env)
        try:
            published = business(dsn, 1, 40, seed=1)
            with psycopg.connect(dsn, autocommit=True) as conn:
                wait_for(conn, published, sink="order_totals", timeout=30)  # read-your-writes
                show("order_totals after 40 orders (the relay applied them):", conn.execute(READ_MODEL).fetchall())
                ok = conn.execute(READ_MODEL).fetchall() == conn.execute(FROM_ORDERS).fetchall()
            print(f"  matches the orders table: {ok}")

            print("\nrebuilding order_totals from stored events while 40 more orders come in ...")
            more: list[Any] = []
            producer = threading.Thread(target=lambda: more.extend(business(dsn, 41, 40, seed=2)))
            producer.start()
            rebuild = subprocess.run(cli("rebuild", "order_totals", *PROJECTION), env=env, text=True,
                                     capture_output=True, timeout=300)
            producer.join()
            print("  " + (rebuild.stdout.strip() or rebuild.stderr.strip()))
            if rebuild.returncode != 0:
                print(rebuild.stderr, file=sys.stderr)
                return 1
            with psycopg.connect(dsn, autocommit=True) as conn:
                wait_for(conn, more, sink="order_totals", timeout=30)
                rows = conn.execute(READ_MODEL).fetchall()
                after = rows == conn.execute(FROM_ORDERS).fetchall()
            show("order_totals after the rebuild and 80 orders:", rows)
            print(f"  matches the orders table: {after}")
            return 0 if ok and after else 1
        finally:
            relay.send_signal(signal.SIGTERM)
            code = relay.wait(30)
            print(f"\nrelay drained and exited with {code}")


if __name__ == "__main__":
    sys.exit(main())
