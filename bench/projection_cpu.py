"""CPU per event of live projection relays: the load-insensitive figure of the `projection` case.

    python bench/projection_cpu.py --relays 1,4 --events 100000 --runs 2
    python bench/projection_cpu.py --relays 1 --spy /tmp/relay.txt   # py-spy (on-CPU samples) of the relay

The same released-backlog drain as `run.py --cases projection` (projection_cases.projection_once), with
the backlog loaded server-side (``INSERT ... SELECT generate_series`` in transactions of --tx-size through
the events' ordinary triggers, the payloads ``Bench.payload`` makes) so that the relays are paused for
seconds, not the tens of seconds ``publish_many`` takes on a loaded machine. Reports per run: events/s
(wall clock: only meaningful on a quiet machine) and CPU microseconds per event of the relay processes, of
their PostgreSQL sessions and of the rest of the server, from release to the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import projection_cases  # noqa: E402
import psycopg  # noqa: E402
import run  # noqa: E402
from servers import Servers  # noqa: E402

LOAD = """
CREATE PROCEDURE pg_temp.bench_load(n bigint, tx bigint, keys bigint, topic text)
LANGUAGE plpgsql AS $$
DECLARE lo bigint := 0;
BEGIN
    WHILE lo < n LOOP
        INSERT INTO outbox.events (partition_key, topic, type, payload)
        SELECT 'order:' || (g % keys), topic, 'bench.order_paid',
               jsonb_build_object('order_id', g, 'amount_cents', 1000 + g % 9000, 'currency', 'EUR',
                                  'customer', 'customer-' || (g % 5000), 'note', 'outbox-relay bench event')
        FROM generate_series(lo, least(n, lo + tx) - 1) AS g
        ORDER BY g;
        COMMIT;
        lo := lo + tx;
    END LOOP;
END $$;
"""


def load_backlog(bench: run.Bench, dsn: str, n: int, topic: str) -> float:
    """``Bench.publish_backlog`` done by the server: the same events, in transactions of --tx-size."""
    start = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(LOAD)
        conn.execute("CALL pg_temp.bench_load(%s, %s, %s, %s)", (n, bench.args.tx_size, bench.args.keys, topic))
    return time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--relays", default="1,4")
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--handler", default="batched", choices=sorted(projection_cases.REBUILD_HANDLERS))
    p.add_argument("--batch-size", type=int, default=0, help="relay --batch-size (0: the relay's own default)")
    p.add_argument("--spy", type=Path, help="py-spy raw stacks of the first relay (on-CPU samples) to this file")
    p.add_argument("--relay-args", default="", help="more `outbox-relay run` arguments")
    a = p.parse_args()
    args = run.parse_args(["--cases", "projection", "--events", str(a.events),
                           "--projection-batch-size", str(a.batch_size), "--relay-args", a.relay_args])
    results: list[dict[str, Any]] = []
    with Servers(keep=False) as servers:
        bench = run.Bench(args, servers)
        bench.publish_backlog = lambda dsn, n, topic: load_backlog(bench, dsn, n, topic)  # type: ignore[method-assign]
        for r in range(a.runs):
            for relays in (int(x) for x in a.relays.split(",")):
                out = projection_cases.projection_once(bench, relays, r == 0, r, a.handler,
                                                       spy=a.spy if r == 0 and relays == 1 else None,
                                                       spy_idle=False)
                us = out["cpu_us_per_event"]
                print(f"{a.handler} relays={relays} run={r + 1}: {out['events_per_s']:,.0f} ev/s, pause "
                      f"{out['pause_seconds']:.1f}s; CPU us/event: relays {us['relays']:.1f}, their postgres "
                      f"{us['postgres for relays']:.1f}, other postgres {us['postgres other']:.1f}, machine "
                      f"{us['machine']:.1f}" + (f"; check ok={out['check']['ok']}" if "check" in out else ""),
                      flush=True)
                results.append(out)
    for relays in sorted({o["relays"] for o in results}):
        rs = [o for o in results if o["relays"] == relays]
        med = {k: statistics.median(o["cpu_us_per_event"][k] for o in rs) for k in ("relays", "postgres for relays")}
        rate = statistics.median(o["events_per_s"] for o in rs)
        print(f"median, {relays} relays: relays {med['relays']:.1f} us/event, their postgres "
              f"{med['postgres for relays']:.1f} us/event, {rate:,.0f} ev/s")
    print(json.dumps([{k: v for k, v in o.items() if k != "check"} for o in results], default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
