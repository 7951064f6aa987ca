"""Held-xmin bench: what the relays' bookkeeping tables collect while a writing transaction stays open.

Issue 16's scenario (a third-party harness's): relays deliver 500 events/s to Kafka (Tansu) while a
session in another database of the same server holds a writing transaction open for 45 s. Vacuum and
page pruning can remove no row version that transaction might still see, so every UPDATE of a
bookkeeping row leaves one dead version behind until it ends.

Per run and variant (interleaved: run 1 of every variant, then run 2, ...), with ``run.py``'s latency
harness (producer and consumer processes, `outbox-relay run` relays, the transaction opened before the
producer starts and rolled back once the consumer has everything):

- the bookkeeping tables the relay writes (``outbox.cursors``, ``workers``, ``parked``, ``assignments``,
  ``housekeeping``, ``dead_letters``, ``history``): exact live and dead row versions and size, table
  plus indexes (``pgstattuple``), and updates / HOT updates (``pg_stat_user_tables``), before the
  producer starts (the transaction already open), at the end of the window (still open), and
  ``--after-seconds`` after the rollback;
- commit -> produce() (pickup) p50/p99, commit -> consumer p99, duplicates.

Variants are relay options (``--variants``, ``name=options;...``): by default ``every-batch``
(``--cursor-flush-seconds 0``: a cursor row written by every batch, the code before the checkpoint
writes were bounded) next to ``coalesced`` (the default: a bucket's cursor written at most once per
``cursor_flush_seconds``, its fence checked by every batch).

    python bench/held_xmin.py                       # 45 s at 500 ev/s, 2 relays, 3 runs (~10 minutes)
    python bench/held_xmin.py --runs 1 --seconds 20 # a quick look

Prints a Markdown table; the raw figures go to bench/results/held-xmin-<time>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from run import RESULTS, Bench, parse_args
from servers import Servers, machine

TABLES = ("cursors", "workers", "parked", "assignments", "housekeeping", "dead_letters", "history")
DEFAULT_VARIANTS = "every-batch=--cursor-flush-seconds 0;coalesced="
# A variant's option "@DIR" runs its relays from the source tree DIR (PYTHONPATH) instead of this one:
# older code side by side, e.g. `git archive <commit> | tar -x -C DIR`.


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bookkeeping(dsn: str) -> dict[str, dict[str, Any]]:
    """Per bookkeeping table: exact row versions (pgstattuple scans it), size with indexes, and the
    update counters. The counters come from the statistics system, which backends report at most
    once a second: read after a short wait."""
    out: dict[str, dict[str, Any]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
        for t in TABLES:
            name = f"outbox.{t}"
            if conn.execute("SELECT to_regclass(%s)", (name,)).fetchone() == (None,):
                continue
            live, dead, table_bytes = conn.execute(  # type: ignore[misc]
                "SELECT tuple_count, dead_tuple_count, table_len FROM pgstattuple(%s::regclass)", (name,)).fetchone()
            total, upd, hot, n_dead = conn.execute(  # type: ignore[misc]
                "SELECT pg_total_relation_size(relid), n_tup_upd, n_tup_hot_upd, n_dead_tup "
                "FROM pg_stat_user_tables WHERE relid = %s::regclass", (name,)).fetchone()
            out[t] = {"live": live, "dead": dead, "table_bytes": table_bytes, "total_bytes": total,
                      "updates": upd, "hot_updates": hot, "n_dead_tup": n_dead}
    return out


class HeldXmin(Bench):
    """run.py's latency harness with one set of relay options per variant, and the bookkeeping
    tables read before, during and after the held transaction."""

    def __init__(self, args: argparse.Namespace, servers: Servers) -> None:
        super().__init__(args, servers)
        self.variant_args: list[str] = []
        self.variant_src: str | None = None
        self.dsn = ""
        self.after: dict[str, Any] = {}

    def fresh_outbox_db(self) -> tuple[str, str]:
        name, self.dsn = super().fresh_outbox_db()
        return name, self.dsn

    def start_relays(self, n: int, dsn: str, topic: str, tag: str, extra: Sequence[str] = (),
                     projections: bool = False, acks_to: Sequence[Path] = (), batch_size: int | None = -1,
                     ) -> list[tuple[str, Any]]:
        if self.variant_src is None:
            return super().start_relays(n, dsn, topic, tag, [*extra, *self.variant_args], projections,
                                        acks_to=acks_to, batch_size=batch_size)
        # `python -m` puts the working directory first on sys.path: start them from that tree.
        here = os.getcwd()
        os.chdir(self.variant_src)
        try:
            return super().start_relays(n, dsn, topic, tag, [*extra, *self.variant_args], projections,
                                        acks_to=acks_to, batch_size=batch_size)
        finally:
            os.chdir(here)

    def relay_env(self, dsn: str, projections: bool = False) -> dict[str, str]:  # type: ignore[override]
        env = super().relay_env(dsn, projections)
        if self.variant_src is not None:
            env["PYTHONPATH"] = self.variant_src
        return env

    def hot_table(self, dsn: str, kind: str) -> dict[str, Any]:  # type: ignore[override]
        time.sleep(1.5)  # the statistics of the last second reach the counters
        return bookkeeping(dsn)

    def close_long_transaction(self, conn: psycopg.Connection[Any], since: float) -> float:
        held = super().close_long_transaction(conn, since)
        # Relays keep running meanwhile: what their bookkeeping looks like once vacuum may work again.
        time.sleep(self.args.after_seconds)
        self.after = bookkeeping(self.dsn)
        return held


def pct_of(rows: list[dict[str, Any]], key: str) -> str:
    vals = [r[key] for r in rows if r.get(key) is not None]
    if not vals:
        return "-"
    return f"{statistics.median(vals):,.0f} ({min(vals):,.0f}-{max(vals):,.0f})"


def table(results: list[dict[str, Any]], variants: list[str]) -> str:
    lines = ["| variant | phase | cursors dead | cursors size kB | cursors updates (HOT) | workers dead | "
             "other bookkeeping dead | pickup p50 / p99 ms | consumer p99 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        rows = [r for r in results if r["variant"] == v]
        for phase in ("table_before", "table_after", "after_release"):
            label = {"table_before": "before (held)", "table_after": "end of window (held)",
                     "after_release": "after release"}[phase]

            def med(table: str, key: str, rows: list[dict[str, Any]] = rows, phase: str = phase) -> float:
                return statistics.median(r[phase].get(table, {}).get(key, 0) for r in rows)

            upd = med("cursors", "updates") - statistics.median(r["table_before"]["cursors"]["updates"] for r in rows)
            hot = med("cursors", "hot_updates") - statistics.median(
                r["table_before"]["cursors"]["hot_updates"] for r in rows)
            other = statistics.median(
                sum(t.get("dead", 0) for n, t in r[phase].items() if n not in ("cursors", "workers")) for r in rows)
            lat = (f"{pct_of(rows, 'pickup_p50_ms')} / {pct_of(rows, 'pickup_p99_ms')}"
                   if phase == "table_after" else "")
            lines.append(f"| {v} | {label} | {med('cursors', 'dead'):,.0f} "
                         f"| {med('cursors', 'total_bytes') / 1024:,.0f} | {upd:,.0f} ({hot:,.0f}) "
                         f"| {med('workers', 'dead'):,.0f} | {other:,.0f} | {lat} | "
                         f"{pct_of(rows, 'p99_ms') if phase == 'table_after' else ''} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=500.0, help="events/s published (default 500)")
    p.add_argument("--seconds", type=float, default=45.0, help="publishing window with the transaction held")
    p.add_argument("--relays", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--after-seconds", type=float, default=15.0,
                   help="how long after the rollback the tables are read again (relays still running)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help="name=relay options;... (default: %(default)r)")
    p.add_argument("--keep", action="store_true")
    own = p.parse_args(argv)
    variants = [(name.strip(), shlex.split(opts)) for name, _, opts in
                (v.partition("=") for v in own.variants.split(";") if v.strip())]
    # run.py's options for everything else (keys, tick, batch size, ...), at their defaults.
    args = parse_args(["--runs", str(own.runs)])
    args.after_seconds = own.after_seconds
    results: list[dict[str, Any]] = []
    with Servers(keep=own.keep) as servers:
        assert servers.postgres is not None
        bench = HeldXmin(args, servers)
        log(f"servers up: PostgreSQL {servers.postgres.version}; {len(variants)} variants x {own.runs} runs, "
            f"{own.rate:.0f} ev/s for {own.seconds:.0f}s, {own.relays} relays")
        for run in range(own.runs):
            for name, opts in variants:
                bench.variant_args = [o for o in opts if not o.startswith("@")]
                bench.variant_src = next((o[1:] for o in opts if o.startswith("@")), None)
                r = bench.latency_once("ours", own.rate, own.relays, run, own.seconds, longtx=True)
                r["variant"] = name
                r["after_release"] = bench.after
                log(f"{name} run {run + 1}: cursors dead {r['table_before']['cursors']['dead']} -> "
                    f"{r['table_after']['cursors']['dead']} -> {r['after_release']['cursors']['dead']} after release; "
                    f"size {r['table_after']['cursors']['total_bytes'] // 1024} kB; "
                    f"pickup p99 {r['pickup_p99_ms']} ms; "
                    f"received {r['received']}/{r['sent']}, duplicates {r['duplicates']}")
                results.append(r)
        meta = {"machine": machine(), "postgres": servers.postgres.version, "rate": own.rate,
                "seconds": own.seconds, "relays": own.relays, "runs": own.runs, "variants": dict(variants)}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"held-xmin-{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps({"meta": meta, "runs": results}, indent=1, default=str))
    print(f"held xmin: {own.rate:.0f} ev/s for {own.seconds:.0f}s, {own.relays} relays, "
          f"medians (min-max) of {own.runs} runs; {meta['machine']}\n")
    print(table(results, [n for n, _ in variants]))
    log(f"raw figures: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
