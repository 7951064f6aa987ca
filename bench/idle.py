"""Idle case: what a deployment with nothing to deliver costs, and how soon the first event after a
quiet spell is delivered; called from run.py (``--cases idle``).

For each relay count (--idle-relays, default 1,4) and each code version (this tree, and with
--idle-baseline DIR also the code exported there, e.g. ``git archive main | tar -x -C DIR``, on a
database that code migrated), in one run:

1. The relays (Kafka sink, default settings, bench/ack_relay.py) start, settle on the assignment and
   deliver one warm-up event per bucket; then nothing is published for --idle-settle seconds.
2. An idle window of --idle-seconds: CPU time (utime + stime from /proc) of the relay processes, of
   their PostgreSQL backends (application_name ``outbox-relay ...``) and of the server's own
   processes (checkpointer, WAL writer, autovacuum...: there without any relay), as % of one core.
   CPU time, not wall time: other work on the machine changes it little.
3. --idle-events single-event commits, each after a quiet gap of --idle-gap seconds plus a random
   0-1 s (so that commits land at any phase of the watcher's interval): commit -> the broker's ack
   (the relay's own ack time, same clock), p50 / p99 / max.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cpu
import psycopg

from outbox_relay import Outbox

if TYPE_CHECKING:
    from run import Bench

SINK = "kafka"
PARTITIONS = 8


def log(msg: str) -> None:  # as run.log (run.py is __main__: importing it would load it twice)
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _pct(p: float, xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def migrate_with(code: Path | None, dsn: str, sink: str = "kafka") -> None:
    """Migrate and register the sink with the code under test (a baseline's own schema)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    if code is not None:
        env["PYTHONPATH"] = str(code)
    script = ("import sys, psycopg, outbox_relay; from outbox_relay import migrate, store; "
              "code = sys.argv[3] or None; "
              "assert code is None or outbox_relay.__file__.startswith(code), outbox_relay.__file__; "
              "migrate(sys.argv[1]); c = psycopg.connect(sys.argv[1], autocommit=True); "
              "store.register_sink(c, sys.argv[2], 'kafka')")
    # In its directory: `python -c` puts the working directory first on sys.path.
    subprocess.run([sys.executable, "-c", script, dsn, sink, str(code or "")], env=env, check=True, cwd=code)


def _threads(pids: list[int]) -> dict[str, float]:
    """CPU seconds so far of the relays' threads by kind: librdkafka's (named rdk:...) and Python's."""
    out = {"librdkafka threads": 0.0, "python threads": 0.0}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                comm = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kind = "librdkafka threads" if comm.startswith("rdk:") else "python threads"
            out[kind] += (int(fields[11]) + int(fields[12])) / cpu.TICK
    return out


def idle_once(bench: Bench, version: str, code: Path | None, relays_n: int,
              extra: tuple[str, ...] = ()) -> dict[str, Any]:
    a = bench.args
    tag = f"idle-{''.join(c for c in version if c.isalnum())}-{relays_n}r"
    name = bench.pg.create_database("idle")
    dsn = bench.pg.dsn(name)
    migrate_with(code, dsn)
    topic = bench.kafka.create_topic(tag, PARTITIONS)
    acks_paths = [bench.base / f"{tag}-acks-{i}.json" for i in range(relays_n)]
    relays = bench.start_relays(relays_n, dsn, topic, tag, acks_to=acks_paths, batch_size=None, code=code,
                                extra=extra)
    out: dict[str, Any] = {"version": version, "relays": relays_n}
    commits: dict[str, float] = {}
    try:
        with psycopg.connect(dsn, autocommit=True) as poll:
            bench.wait_ring(poll, [w for w, _ in relays], relays)
        bench.warm_up(dsn, topic, relays)
        time.sleep(a.idle_settle)
        postmaster = cpu.postmaster_pid(bench.pg.dir)
        with psycopg.connect(bench.pg.admin_dsn, autocommit=True) as admin:
            own = admin.info.backend_pid

            def backends(relay_side: bool, watching: bool | None = None) -> list[int]:
                rows = admin.execute("SELECT pid, application_name, query LIKE '%%watch_commits%%' "
                                     "FROM pg_stat_activity").fetchall()
                apps = {r[0]: r[1] for r in rows}
                watcher = {r[0] for r in rows if r[2]}
                pids = [postmaster, *cpu.children(postmaster)] if postmaster else []
                return [p for p in pids if p != own and p != postmaster
                        and str(apps.get(p, "")).startswith("outbox-relay") == relay_side
                        and (relay_side or not apps.get(p))  # the server's own: no application name
                        and (watching is None or (p in watcher) == watching)]

            relay_pids = [p.pid for _, p in relays]
            threads0 = _threads(relay_pids)
            window = cpu.CpuWindow({"relays": lambda: relay_pids,
                                    "their backends": lambda: backends(True),
                                    "watching backend": lambda: backends(True, watching=True),
                                    "server processes": lambda: backends(False)})
            xacts = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s"
            (tx0,) = admin.execute(xacts, (name,)).fetchone()  # type: ignore[misc]
            window.start()
            time.sleep(a.idle_seconds)
            out["cpu"] = window.stop()
            admin.execute("SELECT pg_stat_force_next_flush()")
            time.sleep(1.5)  # the relays' backends flush their counters within a second
            (tx1,) = admin.execute(xacts, (name,)).fetchone()  # type: ignore[misc]
            out["transactions_per_second"] = (tx1 - tx0) / window.elapsed
            threads1 = _threads(relay_pids)
            out["cpu"].update({k: (threads1[k] - threads0[k]) / window.elapsed for k in threads1})
        out["cpu"]["deployment"] = out["cpu"]["relays"] + out["cpu"]["their backends"]
        log(f"  {tag}: idle CPU {100 * out['cpu']['deployment']:.2f}% of a core "
            f"(relays {100 * out['cpu']['relays']:.2f}%, their backends {100 * out['cpu']['their backends']:.2f}%)")
        outbox = Outbox(default_topic=topic)
        with psycopg.connect(dsn) as conn:
            for i in range(a.idle_events):
                time.sleep(a.idle_gap + random.random())
                pub = outbox.publish(conn, type="bench.idle", key=f"idle:{i}", payload={"i": i})
                conn.commit()
                commits[str(pub.id)] = time.time()
            targets = bench.targets(conn)
        with psycopg.connect(dsn, autocommit=True) as poll:
            bench.wait_delivered(poll, targets, relays, timeout=60)
    finally:
        bench.stop_relays(relays)  # each writes its ack times as it exits
        bench.pg.drop_database(name)
    acked: dict[str, float] = {}
    for path in acks_paths:
        for i, t in json.loads(path.read_text())["acks"].items():
            acked[i] = min(t, acked.get(i, t))
    lat = [(acked[i] - t) * 1000 for i, t in commits.items() if i in acked]
    out.update({"events": len(commits), "acked": len(lat), "p50_ms": _pct(50, lat), "p99_ms": _pct(99, lat),
                "max_ms": max(lat) if lat else None, "latencies_ms": sorted(lat)})
    log(f"  {tag}: first event after a quiet gap, commit -> ack p50 {out['p50_ms']:.1f} ms, "
        f"p99 {out['p99_ms']:.1f} ms, max {out['max_ms']:.1f} ms ({len(lat)}/{len(commits)} acked)")
    return out


def case_idle(bench: Bench) -> None:
    a = bench.args
    versions: list[tuple[str, Path | None, tuple[str, ...]]] = [("this tree", None, ())]
    versions += [(f"this tree, --watch-max-interval-ms {ms}", None, ("--watch-max-interval-ms", ms))
                 for ms in a.idle_max_intervals]
    if a.idle_baseline:
        versions.insert(0, ("baseline", Path(a.idle_baseline).resolve(), ()))
    rs = bench.results.setdefault("idle", [])
    for run in range(a.idle_runs):
        for n in a.idle_relays:
            for version, code, extra in versions:
                log(f"idle: {version}, {n} relay(s), run {run + 1}")
                r = idle_once(bench, version, code, n, extra)
                r["run"] = run
                rs.append(r)


def report_rows(a: Any, rs: list[dict[str, Any]]) -> list[str]:
    """Markdown table: one row per version and relay count (medians over runs; latency over all events)."""
    lines = [f"Idle {a.idle_seconds:.0f} s after {a.idle_settle:.0f} s without events (CPU as % of one core, "
             f"utime+stime from /proc); then {a.idle_events} single-event commits per run, each after "
             f"{a.idle_gap:.0f}-{a.idle_gap + 1:.0f} s of quiet, commit -> broker ack.", "",
             "| version | relays | relays' CPU (librdkafka / Python threads) | their backends' CPU (the watching one) "
             "| deployment | server's own processes | transactions/s | first event p50 / p99 / max ms |",
             "|---|---|---|---|---|---|---|---|"]
    seen: list[tuple[str, int]] = []
    for r in rs:
        if (r["version"], r["relays"]) not in seen:
            seen.append((r["version"], r["relays"]))
    for version, n in seen:
        group = [r for r in rs if r["version"] == version and r["relays"] == n]

        def med(key: str, group: list[dict[str, Any]] = group) -> float:
            vals = sorted(100 * r["cpu"][key] for r in group)
            return vals[len(vals) // 2]

        lat = [x for r in group for x in r["latencies_ms"]]
        lines.append(f"| {version} | {n} | {med('relays'):.2f}% ({med('librdkafka threads'):.2f} / "
                     f"{med('python threads'):.2f}) | {med('their backends'):.2f}% ({med('watching backend'):.2f}) "
                     f"| **{med('deployment'):.2f}%** | {med('server processes'):.2f}% "
                     f"| {statistics.median(r['transactions_per_second'] for r in group):.1f} "
                     f"| {_pct(50, lat) or 0:.1f} / {_pct(99, lat) or 0:.1f} / {max(lat, default=0):.1f} "
                     f"({len(lat)} events) |")
    return lines
