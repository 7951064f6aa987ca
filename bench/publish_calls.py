"""Client cost of one publish call, for instruction counts: a loop of calls, each rolled back.

    valgrind --tool=callgrind --callgrind-out-file=/dev/null python bench/publish_calls.py DSN CASE N

Run it with CASE ``none`` too and subtract: what is left, divided by N + 20 (the warm-up calls count
too), is the client's instructions per call, psycopg included, the server excluded (load does not
change them). Set PYTHONHASHSEED=0; PYTHONPATH=/other/tree compares two trees (run from outside
either). Cases: none, e (publish), e_key (publish with an idempotency key), d_key (the SQL path with a
key), many / many_key (publish_many of 100 plain dicts, without / with keys).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import psycopg

from outbox_relay import Outbox

PAYLOAD = {"order_id": "x-1", "customer_id": 5, "currency": "EUR", "amount_cents": 1234, "status": "placed",
           "lines": [{"sku": "SKU-00001", "qty": 2} for _ in range(2)], "placed_at": "2026-11-26T10:15:00Z"}
SQL_KEYED = ("INSERT INTO outbox.events (topic, partition_key, type, payload, idempotency_key) "
             "VALUES (%s, %s, %s, %s, %s)")


def main() -> None:
    dsn, case, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    outbox = Outbox(default_topic="orders")
    tag = str(time.time())

    def one(conn: psycopg.Connection[Any], i: object) -> None:
        ikey = f"{case}-{i}-{tag}"
        if case == "e_key":
            outbox.publish(conn, type="order.placed", key="customer:1", payload=PAYLOAD, topic="orders",
                           idempotency_key=ikey)
        elif case == "e":
            outbox.publish(conn, type="order.placed", key="customer:1", payload=PAYLOAD, topic="orders")
        elif case == "d_key":
            conn.execute(SQL_KEYED, ("orders", "customer:1", "order.placed", json.dumps(PAYLOAD), ikey))
        elif case in ("many", "many_key"):
            outbox.publish_many(conn, [
                {"type": "order.placed", "key": f"customer:{j}", "payload": PAYLOAD, "topic": "orders",
                 **({"idempotency_key": f"{ikey}-{j}"} if case == "many_key" else {})} for j in range(100)])
        elif case != "none":
            raise SystemExit(f"unknown case {case!r}")
        conn.rollback()

    with psycopg.connect(dsn) as conn:
        for i in range(20):
            one(conn, f"w{i}")
        for i in range(n):
            one(conn, i)


if __name__ == "__main__":
    main()
