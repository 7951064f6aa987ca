"""Bench cases for read models and stored history, called from run.py with its ``Bench``.

    projection  a released backlog applied by 1/2/4 `outbox-relay run --no-kafka --projection` processes
    rebuild     `outbox-relay rebuild` of that projection over --rebuild-events stored events, 1 and 2 processes
    (history: retention by partition is measured by bench/history.py since schema version 14)
                transaction, then the claim cost on what is left
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cpu
import psycopg
from bench_projection import SCHEMA

from outbox_relay.sqlfiles import query

if TYPE_CHECKING:
    from run import Bench

PROJECTION = "bench_totals"
PROJECTION_ARGS = ["--no-kafka", "--projections", "bench_projection", "--projection", PROJECTION]
REBUILD_SINK = PROJECTION + ".rebuild"

# Per customer, what the stored order events say; a correct read model matches it row for row.
EXPECTED_TOTALS = """
SELECT payload->>'customer' AS customer, count(*)::int AS orders, sum((payload->>'amount_cents')::bigint) AS cents
FROM outbox.events WHERE type = 'bench.order_paid' {where} GROUP BY 1
"""
# The same, for events at or below the projection's cursors only (what it has applied).
APPLIED = ("AND EXISTS (SELECT 1 FROM outbox.cursors c WHERE c.sink = %(sink)s AND c.bucket = events.bucket "
           "AND outbox.delivered_v1(events.xid, events.seq, c.snapshot, c.target, c.after_xid, c.after_seq))")


def log(msg: str) -> None:  # as run.log (run.py is __main__: importing it would load it twice)
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def check_totals(conn: psycopg.Connection[Any], applied_by: str | None = None) -> dict[str, Any]:
    """Compare bench_totals with the stored events, per customer (both ways). ``applied_by``: only
    the events that sink's cursors have passed (a rebuild leaves the last few to the live relay)."""
    expected = EXPECTED_TOTALS.format(where=APPLIED if applied_by else "")
    params = {"sink": applied_by} if applied_by else None
    row = conn.execute(
        f"WITH want AS ({expected}), got AS (SELECT customer, orders, cents FROM bench_totals) "
        "SELECT (SELECT count(*) FROM ((TABLE want EXCEPT TABLE got) UNION ALL (TABLE got EXCEPT TABLE want)) d), "
        "(SELECT coalesce(sum(orders), 0) FROM got), (SELECT coalesce(sum(cents), 0) FROM got), "
        "(SELECT coalesce(sum(orders), 0) FROM want), (SELECT coalesce(sum(cents), 0) FROM want)", params).fetchone()
    assert row is not None
    return {"mismatched_customers": row[0], "orders": row[1], "cents": row[2],
            "expected_orders": row[3], "expected_cents": row[4], "ok": row[0] == 0}


# -- projection: a released backlog through 1/2/4 projection relays --------------------------------


def projection_once(bench: Bench, relays_n: int, verify: bool, run: int, handler: str = "per-event",
                    spy: Path | None = None, spy_idle: bool = True) -> dict[str, Any]:
    """As drain_once in warm mode, with relays that run the projection instead of Kafka; ``handler``:
    per-event (one upsert per event) or batched (one set-based upsert per batch, ``batch=True``).
    ``spy``: record the first relay with py-spy (raw stacks to that file) from before the release."""
    n = bench.args.events
    sink = REBUILD_HANDLERS[handler]
    name, dsn = bench.fresh_outbox_db()
    topic = "bench-projection"  # stored on the events only; no broker involved
    relays: list[tuple[str, subprocess.Popen[bytes]]] = []
    out: dict[str, Any] = {"relays": relays_n, "run": run, "handler": handler}
    try:
        with psycopg.connect(dsn, autocommit=True) as poll:
            poll.execute(SCHEMA)
            args = [*PROJECTION_ARGS[:-1], sink]
            relays = bench.start_relays(relays_n, dsn, topic, f"proj{relays_n}r{run}", args, projections=True,
                                        batch_size=bench.args.projection_batch_size or None)
            out["settle_seconds"] = bench.wait_ring(poll, [w for w, _ in relays], relays, sink=sink)
            warmups = bench.warm_up(dsn, topic, relays, sink=sink, type_="bench.order_paid",
                                    payload={"customer": "warmup", "amount_cents": 0})
            spy_proc = None
            if spy is not None:
                exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
                spy_proc = subprocess.Popen([exe, "record", "--pid", str(relays[0][1].pid), "--rate", "200",
                                             *(["--idle"] if spy_idle else []),
                                             "--nonblocking", "--format", "raw", "--output", str(spy)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            window = relay_cpu_window(bench, relays)
            targets, t0 = bench.release_backlog(dsn, n, topic, relays, out, on_release=window.start)
            t_end = bench.wait_delivered(poll, targets, relays, timeout=bench.args.drain_timeout, sink=sink)
            shares = window.stop()
            # CPU per event from release to the last checkpoint (load-insensitive, unlike events/s): the relay
            # processes, their PostgreSQL sessions, and the rest of the server (autovacuum, WAL writer, ...).
            out["cpu_us_per_event"] = {k: v * window.elapsed / n * 1e6 for k, v in shares.items()}
            if spy_proc is not None:
                spy_proc.send_signal(signal.SIGINT)
                spy_proc.wait(30)
            out["seconds"] = t_end - t0
            out["events_per_s"] = n / (t_end - t0)
            out["peak_rss_mb"] = {wid: bench.peak_rss_mb(p.pid) for wid, p in relays}
            if verify:
                out["check"] = check_totals(poll)
                out["check"]["published_cents"] = sum(bench.payload(i)["amount_cents"] for i in range(n))
                out["check"]["warmup_orders"] = warmups  # customer "warmup", 0 cents
                c = out["check"]
                if not (c["ok"] and c["orders"] == n + warmups and c["cents"] == c["published_cents"]):
                    raise RuntimeError(f"projection: bench_totals does not match the published events: {c}")
    finally:
        bench.stop_relays(relays)
        bench.pg.drop_database(name)
    return out


def relay_cpu_window(bench: Bench, relays: list[tuple[str, subprocess.Popen[bytes]]]) -> cpu.CpuWindow:
    """CPU of the relay processes, of their PostgreSQL sessions (application name ``outbox-relay ...``)
    and of the server's other processes, between ``start()`` and ``stop()``."""
    postmaster = cpu.postmaster_pid(bench.pg.dir)

    def backends(of_relays: bool) -> list[int]:
        pids = [postmaster, *cpu.children(postmaster)] if postmaster else []
        with psycopg.connect(bench.pg.admin_dsn, autocommit=True) as conn:
            apps = dict(conn.execute("SELECT pid, application_name FROM pg_stat_activity").fetchall())
        return [p for p in pids if str(apps.get(p) or "").startswith("outbox-relay") == of_relays]

    return cpu.CpuWindow({"relays": lambda: [p.pid for _, p in relays],
                          "postgres for relays": lambda: backends(True),
                          "postgres other": lambda: backends(False)})


def case_projection(bench: Bench) -> None:
    runs = []
    for run in range(bench.args.runs):  # interleaved: every relay count and handler, then the next run
        for relays_n in bench.args.relays:
            for handler in bench.args.projection_handlers:
                r = projection_once(bench, relays_n, run == 0, run, handler)
                rss = max(v or 0 for v in r["peak_rss_mb"].values())
                us = r["cpu_us_per_event"]
                log(f"projection {handler} {relays_n} relays run {run + 1}: {r['events_per_s']:,.0f} ev/s "
                    f"({r['seconds']:.2f}s, rss {rss:.0f} MB; CPU per event: relays {us['relays']:.1f} us, their "
                    f"postgres sessions {us['postgres for relays']:.1f} us, other postgres {us['postgres other']:.1f} "
                    f"us, machine {us['machine']:.1f} us)" + (f", check {r['check']}" if "check" in r else ""))
                runs.append(r)
    bench.results["projection"] = runs


# -- rebuild: `outbox-relay rebuild` over stored history -----------------------------------------


# The projections a rebuild can replay into bench_totals: per-event upserts, or one set-based upsert per batch.
REBUILD_HANDLERS = {"per-event": PROJECTION, "batched": PROJECTION + "_batched"}


HANDLER_SPEC = re.compile(r"^(sql|per-event|batched)(@base)?(?:#(\d+))?$")


def handler_spec(handler: str) -> tuple[str, bool, int | None]:
    """A --rebuild-handlers entry: KIND[@base][#BATCH_SIZE] as (kind, on the baseline code, batch size);
    batch size None: the bench's --batch-size, 0: none given (the rebuild's default)."""
    m = HANDLER_SPEC.match(handler)
    if m is None:
        raise ValueError(f"--rebuild-handlers: {handler!r} is not KIND[@base][#BATCH_SIZE] (KIND: sql, per-event, "
                         "batched)")
    return m[1], m[2] is not None, int(m[3]) if m[3] is not None else None


def rebuild_once(bench: Bench, dsn: str, procs: int, run: int, handler: str = "per-event") -> dict[str, Any]:
    """Time `outbox-relay rebuild` (procs processes started together) from spawn to the last exit."""
    n = bench.args.rebuild_events
    kind, base, size = handler_spec(handler)
    projection = REBUILD_HANDLERS[kind]
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Each run from the same state: no live sink (a switch-over leaves one), an empty live table.
        conn.execute("DELETE FROM outbox.sinks WHERE name = ANY(%s)",
                     ([p for name in REBUILD_HANDLERS.values() for p in (name, name + ".rebuild")],))
        conn.execute("DROP TABLE IF EXISTS bench_totals")
        conn.execute(SCHEMA)
        conn.execute("CHECKPOINT")  # no dirty buffers of the previous run left to write
    env = bench.relay_env(dsn, projections=True)
    if base:  # the code before a change, in the same run (--rebuild-baseline)
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], bench.args.rebuild_baseline])
    cmd = [sys.executable, "-m", "outbox_relay.cli", "--log-level", "warning", "rebuild", projection,
           "--projections", "bench_projection"]
    if size != 0:  # 0: the rebuild's own default
        cmd += ["--batch-size", str(size or bench.args.batch_size)]
    logs = [bench.base / f"rebuild-{handler}-{procs}p-r{run}-{i}.log" for i in range(procs)]
    owners: dict[str, int] = {}  # most buckets each rebuild worker held at once
    exits: dict[int, float] = {}
    files = [f.open("wb") for f in logs]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the rebuild processes' CPU, once reaped (poll)
    t0 = time.monotonic()
    # Started outside the source tree: `python -m` puts the working directory first on sys.path, which
    # would run the current tree's code for an @base handler too.
    ps = [subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           cwd=bench.base) for f in files]
    try:
        with psycopg.connect(dsn, autocommit=True) as poll:
            while len(exits) < len(ps):
                now = time.monotonic() - t0
                exits.update({i: now for i, p in enumerate(ps) if i not in exits and p.poll() is not None})
                if now > bench.args.drain_timeout * 4:
                    raise RuntimeError(f"rebuild did not finish within {bench.args.drain_timeout * 4:.0f}s")
                # Who holds the rebuild sink's buckets: do the processes share the work?
                for owner, held in poll.execute("SELECT owner, count(*) FROM outbox.cursors WHERE sink = %s "
                                                "AND owner IS NOT NULL GROUP BY owner", (projection + ".rebuild",)):
                    owners[owner] = max(owners.get(owner, 0), held)
                time.sleep(0.05)
        seconds = max(exits.values())
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    outputs = [f.read_text(errors="replace").strip()[-2000:] for f in logs]
    codes = [p.returncode for p in ps]
    if any(codes):
        raise RuntimeError(f"rebuild with {procs} processes: exit codes {codes}: {outputs}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        # The switch hands the live projection the rebuild's cursors; with no live relay running,
        # whatever the rebuild left for it (at most a batch) is still unapplied.
        row = conn.execute(query("rebuild", "remaining"), {"sink": projection, "types": None, "topics": None}
                           ).fetchone()
        left = int(row[0]) if row else 0
        check = check_totals(conn, applied_by=projection)
        check["all_events"] = check_totals(conn)
    if not check["ok"] or check["expected_orders"] + left != n:  # (no live cursors: not switched over)
        raise RuntimeError(f"rebuild: bench_totals does not match the events the rebuild passed: {check}, "
                           f"{left} left")
    applied = n - left
    return {"handler": handler, "processes": procs, "run": run, "events": n, "applied": applied,
            "left_to_live_relay": left,
            "seconds": seconds, "events_per_s": applied / seconds, "cpu_seconds": cpu,
            "cpu_us_per_event": cpu / max(1, applied) * 1e6, "bucket_owners": owners, "check": check,
            # The process that switches over exits first; the others notice at their next progress poll.
            "first_exit_seconds": min(exits.values()),
            "output": outputs}


def rebuild_sql_once(dsn: str, n: int, run: int) -> dict[str, Any]:
    """The same read model built by one plain ``INSERT ... SELECT`` over the stored events, into a
    scratch table: what the database alone takes, the floor a rebuild through the relay is compared with."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS bench_totals_sql")
        conn.execute(SCHEMA.replace("bench_totals", "bench_totals_sql"))
        t = time.monotonic()
        with conn.transaction():
            conn.execute("INSERT INTO bench_totals_sql (customer, orders, cents) "
                         "SELECT payload->>'customer', count(*), sum((payload->>'amount_cents')::bigint) "
                         "FROM outbox.events WHERE type = 'bench.order_paid' GROUP BY 1")
        seconds = time.monotonic() - t
        conn.execute("DROP TABLE bench_totals_sql")
    return {"handler": "sql", "processes": 0, "run": run, "events": n, "applied": n, "seconds": seconds,
            "events_per_s": n / seconds}


def case_rebuild(bench: Bench) -> None:
    n = bench.args.rebuild_events
    name, dsn = bench.fresh_outbox_db()
    runs = []
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            t = time.monotonic()
            bench.load_events(conn, 1, n, type_="bench.order_paid", topic="bench-orders",
                              payload_sql=bench.ORDER_PAYLOAD, age="1 day", chunk=bench.args.rebuild_tx_events)
            conn.execute("VACUUM ANALYZE outbox.events")  # hint bits and statistics, as a settled table has
            log(f"rebuild: {n:,} events loaded in {time.monotonic() - t:.0f}s "
                f"(transactions of {min(n, bench.args.rebuild_tx_events):,}), "
                f"{bench.table_sizes(conn)['total_bytes'] / 2**20:.0f} MiB")
        for run in range(bench.args.runs):
            if "sql" in bench.args.rebuild_handlers:
                r = rebuild_sql_once(dsn, n, run)
                log(f"rebuild {n:,} events, plain INSERT ... SELECT (the floor: no relay) run {run + 1}: "
                    f"{r['events_per_s']:,.0f} ev/s ({r['seconds']:.1f}s)")
                runs.append(r)
            for procs, handler in ((p, h) for p in bench.args.rebuild_procs for h in bench.args.rebuild_handlers
                                   if h != "sql"):
                r = rebuild_once(bench, dsn, procs, run, handler)  # handlers interleaved: ratios on one machine state
                log(f"rebuild {n:,} events, {handler} handler, {procs} process{'es' if procs > 1 else ''} run "
                    f"{run + 1}: "
                    f"{r['events_per_s']:,.0f} ev/s ({r['seconds']:.1f}s, the rebuild processes' CPU "
                    f"{r['cpu_us_per_event']:.1f} us/event, {r['left_to_live_relay']} left to the "
                    f"live relay, bucket owners {r['bucket_owners']}, table total {r['check']['cents']:,} cents "
                    f"= events {r['check']['expected_cents']:,})")
                runs.append(r)
    finally:
        bench.pg.drop_database(name)
    bench.results["rebuild"] = runs


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    xs = sorted(values)
    return {"p50": xs[len(xs) // 2], "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))], "max": xs[-1]}
