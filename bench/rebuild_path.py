"""The rebuild's per-event Python, without a database: rows as a read returns them turned into
events (store.event_reader), prepared for a batched handler and walked (projections/walk.py),
N events in batches of B. Run it on two source trees under callgrind to compare instruction
counts on a loaded machine, where wall-clock figures are noise:

    valgrind --tool=callgrind --callgrind-out-file=/tmp/new.cg python bench/rebuild_path.py 20000
    PYTHONPATH=/path/to/old/tree valgrind --tool=callgrind ... python bench/rebuild_path.py 20000

(and once with ``--rows-only``: what making the input costs, the same for both). Without valgrind it
prints its own process time per event.
"""

from __future__ import annotations

import sys
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from outbox_relay.store import event_reader
from projections import ProjectionEvent, projection
from projections.walk import Batch, Call, Execute, Reply, walk


@projection("path_totals", events=["bench.order_paid"], tables=["path_totals"], batch=True)
def handler(events: list[ProjectionEvent[Any]], tx: Any) -> None:
    """The bench's batched handler, less its statement."""
    cents: dict[str, int] = {}
    for event in events:
        p = event.payload
        cents[p["customer"]] = cents.get(p["customer"], 0) + p["amount_cents"]


class _Column:
    def __init__(self, name: str) -> None:
        self.name = name


class _Cursor:
    """The columns of relay.fetch_events."""

    description = tuple(_Column(n) for n in (
        "bucket", "xid", "seq", "id", "partition_key", "topic", "type", "payload", "headers", "time", "blocked",
        "id_text", "time_text", "sequence_text", "now", "stored_at", "version"))


def rows(n: int) -> list[tuple[Any, ...]]:
    now = datetime.now(UTC)
    return [(g % 256, 1000 + g // 100, g % 100, uuid.uuid4(), f"order-{g}", "bench-orders", "bench.order_paid",
             f'{{"note": "outbox-relay bench event", "currency": "EUR", "customer": "customer-{g % 5000}", '
             f'"order_id": {g}, "amount_cents": {1000 + g % 9000}}}', "{}", now, False, None, None, None, "1:1:",
             now, 1) for g in range(n)]


def run(all_rows: list[tuple[Any, ...]], size: int) -> None:
    event, _ = event_reader(_Cursor())  # type: ignore[arg-type]
    ok = Reply(None, __import__("psycopg").pq.TransactionStatus.INTRANS)
    for start in range(0, len(all_rows), size):
        events = sorted((event(r) for r in all_rows[start:start + size]), key=lambda e: (e.bucket, e.xid, e.seq))
        steps = walk(Batch(handler, events, {b: 1 for b in range(256)}, replay=True), careful=False,
                     pipelined=True, begin={"idle_ms": "30000", "shadow": "s"})
        step = next(steps)
        try:
            while True:
                if isinstance(step, Call):
                    handler.handler(step.argument, None)
                else:
                    assert isinstance(step, Execute)
                step = steps.send(ok)
        except StopIteration:
            pass


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    data = rows(n)
    if "--rows-only" in sys.argv:  # the cost of making the input, to subtract from a run's count
        return
    started = time.process_time()
    run(data, 2048)
    print(f"{n} events: {(time.process_time() - started) / n * 1e6:.2f} us/event of process time")


if __name__ == "__main__":
    main()
