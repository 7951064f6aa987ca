"""Fleet case: 32 and 64 `outbox-relay run` processes on one database, called from run.py.

What a large fleet costs the database while it has nothing to do, how many relays one commit
wakes, how evenly the stored assignment spreads the buckets, and how long a hand-over takes:

1. N relays (Kafka sink, default settings) start and settle on the stored assignment; one event per bucket
   warms their producers up.
2. An idle window (--fleet-idle-seconds): statements per relay per second, from the server's own
   counters (pg_stat_statements, filtered to the relays' role) and from its statement log (every
   statement with the application_name of its connection, which also shows the empty statements
   psycopg_pool sends to check a connection, that pg_stat_statements does not count); connections
   per relay (pg_stat_activity, sampled every second); housekeeping passes (its statements in
   pg_stat_statements, and the changes of outbox.housekeeping.finished_at); bucket balance
   (owners in outbox.cursors).
3. Single-event commits (--fleet-commits, one every --fleet-commit-gap seconds): how many relays
   each commit wakes. A relay's fetch_events within --fleet-wake-window after a commit that comes
   sooner after its previous one than a poll could is a wake-up; the relay holding the event's
   bucket is always woken, so the share of commits where it shows as woken calibrates the count of
   other relays seen woken.
4. Hand-over: one relay joins (from its spawn, and from its first heartbeat, until every bucket is
   held by the owner the new assignment gives it), then one relay leaves (SIGTERM until the same).

The relays run on a PostgreSQL server of their own (max_connections 400, pg_stat_statements loaded,
every statement logged with its application name), so the other cases' server keeps its defaults.
"""

from __future__ import annotations

import bisect
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.conninfo import make_conninfo
from servers import Postgres

from outbox_relay import Outbox, migrate
from outbox_relay import store as relay_store
from outbox_relay.housekeeping import application_name
from outbox_relay.settings import RelaySettings
from outbox_relay.sqlfiles import queries, sql_dir

if TYPE_CHECKING:
    from run import Bench

SINK = "kafka"
ROLE = "fleet_relay"  # the relays' login: pg_stat_statements keeps statistics per role
CONFIG = {
    "max_connections": "400",
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track_utility": "on",  # BEGIN/COMMIT/LISTEN are round trips too
    # Every statement, with the application name of its connection and the time as Unix epoch.
    "log_min_duration_statement": "0",
    "log_line_prefix": "%n|%a|%p| ",
}
# One line per statement run: "statement:" (simple protocol) or "execute <name>:" (extended); the
# parse and bind steps of the extended protocol log lines of their own, which are not counted.
LOG_LINE = re.compile(r"^(\d+\.\d+)\|([^|]*)\|\d+\| LOG:  duration: [\d.]+ ms  (?:statement|execute [^:]*): ?(.*)$")
EMPTY = "(empty statement: psycopg_pool's connection check)"


def log(msg: str) -> None:  # as run.log (run.py is __main__: importing it would load it twice)
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- naming statements -------------------------------------------------------------------------


def _named_queries() -> dict[str, str]:
    """'group.name' -> the query's text, for every named query in sql/queries."""
    out = {}
    for path in sorted((sql_dir() / "queries").glob("*.sql")):
        for name, body in queries(path.stem).items():
            out[f"{path.stem}.{name}"] = body
    return out


def _purpose_lines() -> dict[str, str]:
    """The first line of each named query (its purpose comment) -> its name: what the statement log
    shows first."""
    return {body.splitlines()[0].strip(): name for name, body in _named_queries().items()
            if body.startswith("--")}


def _shape(text: str) -> str:
    """A query without comments, with single spaces, and with every parameter and constant as ``?``:
    pg_stat_statements shows constants as $n (and drops leading comments), the .sql files show
    parameters as %(name)s."""
    text = " ".join(line.split("--", 1)[0] for line in text.splitlines())
    text = re.sub(r"\$\d+|%\(\w+\)s|'(?:[^']|'')*'|(?<![\w$])\d+(?:\.\d+)?(?!\w)", "?", text)
    return " ".join(text.split())


def label_statement(first_line: str, purposes: dict[str, str]) -> str:
    """A statement log entry's first line -> a query name, or the statement itself."""
    if not first_line.strip():
        return EMPTY
    return purposes.get(first_line.strip(), first_line.strip()[:60])


def label_pss(text: str, named: dict[str, str]) -> str:
    """A pg_stat_statements query text -> the named query of the same shape, else the one it has
    the longest common prefix with (a constant pg_stat_statements folded differently), else the
    text itself."""
    norm = _shape(text)
    shapes = {name: _shape(body) for name, body in named.items()}
    for name, shape in shapes.items():
        if shape == norm:
            return name
    best, best_len = norm[:60], 40  # at least this much in common
    for name, other in shapes.items():
        n = 0
        for a, b in zip(norm, other, strict=False):
            if a != b:
                break
            n += 1
        if n > best_len:
            best, best_len = name, n
    return best


# -- the server and its counters -------------------------------------------------------------------


def start_server(base: Path) -> Postgres:
    pg = Postgres(base, "pg-fleet", CONFIG)
    with psycopg.connect(pg.admin_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {ROLE} LOGIN SUPERUSER")  # fixed name, no input
    return pg


def pss_calls(conn: psycopg.Connection[Any]) -> dict[int, tuple[int, str]]:
    """queryid -> (calls, text) of the relays' role."""
    rows = conn.execute(
        "SELECT s.queryid, sum(s.calls)::bigint, min(s.query) FROM pg_stat_statements s "
        "JOIN pg_roles r ON r.oid = s.userid WHERE r.rolname = %s GROUP BY s.queryid", (ROLE,)).fetchall()
    return {r[0]: (int(r[1]), r[2]) for r in rows}


def pss_delta(before: dict[int, tuple[int, str]], after: dict[int, tuple[int, str]],
              named: dict[str, str]) -> Counter[str]:
    out: Counter[str] = Counter()
    for qid, (calls, text) in after.items():
        n = calls - before.get(qid, (0, text))[0]
        if n:
            out[label_pss(text, named)] += n
    return out


def read_log(path: Path, offset: int, apps: set[str]) -> list[tuple[float, str, str]]:
    """(time, application, first line) of every statement the relays ran, from ``offset`` on."""
    out = []
    with path.open("rb") as f:
        f.seek(offset)
        for raw in f:
            m = LOG_LINE.match(raw.decode(errors="replace").rstrip("\n"))
            if m and m.group(2) in apps:
                out.append((float(m.group(1)), m.group(2), m.group(3)))
    return out


def setting(name: str, relay_args: list[str]) -> float | None:
    """A relay setting as the bench's relays run with it (--relay-args, else the default); None if
    relays of this version do not have it."""
    flag = "--" + name.replace("_", "-")
    if flag in relay_args:
        return float(relay_args[relay_args.index(flag) + 1])
    field = RelaySettings.model_fields.get(name)
    return None if field is None else float(field.default)


def idle_poll_seconds(conn: psycopg.Connection[Any], ids: list[str], relay_args: list[str]) -> float:
    """How long an idle relay waits before it polls: --listen-poll-seconds where relays have it and
    every relay says (in its heartbeat) that its LISTEN connection is up, else --poll-seconds."""
    poll = setting("poll_seconds", relay_args)
    assert poll is not None
    listen_poll = setting("listen_poll_seconds", relay_args)
    if listen_poll is None:
        return poll
    row = conn.execute("SELECT bool_and(coalesce((metadata->>'listening')::boolean, false)) FROM outbox.workers "
                       "WHERE id = ANY(%s)", (ids,)).fetchone()
    return min(poll, listen_poll) if not (row and row[0]) else listen_poll


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "median": statistics.median(values), "max": max(values)}


def owners(conn: psycopg.Connection[Any]) -> dict[int, str | None]:
    return dict(conn.execute("SELECT bucket, owner FROM outbox.cursors WHERE sink = %s", (SINK,)).fetchall())


def balance(held: dict[int, str | None], ids: list[str]) -> dict[str, Any]:
    counts = Counter(o for o in held.values() if o is not None)
    per = [counts.get(w, 0) for w in ids]
    mean = len(held) / len(ids)
    return {"max_over_mean": max(per) / mean, "max": max(per), "min": min(per), "mean": mean,
            "owning_none": sum(1 for c in per if c == 0), "unowned_buckets": sum(1 for o in held.values() if o is None)}


def wanted_owners(conn: psycopg.Connection[Any], ids: list[str]) -> dict[int, str] | None:
    """Which relay should hold each bucket once the relays ``ids`` have settled: the sink's stored
    assignment (None until it is made for exactly these relays)."""
    stored = conn.execute("SELECT members, owners FROM outbox.assignments WHERE sink = %s", (SINK,)).fetchone()
    if stored is None or sorted(stored[0]) != sorted(ids):
        return None
    return dict(enumerate(stored[1]))


def wait_assignment(conn: psycopg.Connection[Any], ids: list[str], relays: list[Any], timeout: float,
                    registered: str | None = None) -> dict[str, float]:
    """Poll until every bucket is held by the owner it should have with the relays ``ids``. Returns
    the time it happened and, with ``registered``, when that worker's first heartbeat landed."""
    deadline = time.monotonic() + timeout
    out: dict[str, float] = {}
    while time.monotonic() < deadline:
        for wid, p in relays:
            if p.poll() is not None:
                raise RuntimeError(f"relay {wid} exited with {p.returncode}")
        if registered and "registered" not in out and conn.execute(
                "SELECT 1 FROM outbox.workers WHERE id = %s", (registered,)).fetchone():
            out["registered"] = time.time()
        held = owners(conn)
        want = wanted_owners(conn, ids)
        if want is not None and len(held) == len(want) and all(want[b] == o for b, o in held.items()):
            out["settled"] = time.time()
            return out
        time.sleep(0.02)
    raise RuntimeError(f"the assignment over {len(ids)} relays did not settle within {timeout:.0f}s")


# -- one run --------------------------------------------------------------------------------------


def fleet_once(bench: Bench, pg: Postgres, n: int, run: int) -> dict[str, Any]:
    a = bench.args
    name = pg.create_database("fleet")
    admin_dsn = pg.dsn(name)
    migrate(admin_dsn)
    relay_dsn = make_conninfo(admin_dsn, user=ROLE)
    topic = bench.kafka.create_topic(f"fleet{n}", 8)
    named = _named_queries()
    purposes = _purpose_lines()
    out: dict[str, Any] = {"relays": n, "run": run}
    relays: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        with psycopg.connect(admin_dsn, autocommit=True, application_name="outbox-bench") as conn:
            relay_store.register_sink(conn, SINK, "kafka")
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            t = time.monotonic()
            relays = bench.start_relays(n, relay_dsn, topic, f"fleet{n}r{run}")
            ids = [w for w, _ in relays]
            apps = {application_name(w) for w in ids}
            bench.wait_ring(conn, ids, relays, timeout=a.fleet_start_timeout)
            out["start_seconds"] = time.monotonic() - t
            bench.warm_up(admin_dsn, topic, relays)
            time.sleep(a.fleet_settle_seconds)  # start-up transients pass (pools, first housekeeping passes)
            log(f"fleet {n} relays run {run + 1}: settled in {out['start_seconds']:.0f}s; idle for "
                f"{a.fleet_idle_seconds:.0f}s")

            # -- idle ------------------------------------------------------------------------
            idle_offset = offset = pg.log_path.stat().st_size
            pss0 = pss_calls(conn)
            t0 = time.time()
            conns: dict[str, list[int]] = defaultdict(list)
            listening: list[int] = []  # per sample: relays' connections whose last statement was LISTEN
            finished: set[Any] = set()
            samples = 0
            while time.time() - t0 < a.fleet_idle_seconds:
                rows = conn.execute(
                    "SELECT application_name, count(*), count(*) FILTER (WHERE query LIKE 'LISTEN %%') "
                    "FROM pg_stat_activity WHERE datname = %s AND application_name = ANY(%s) GROUP BY 1",
                    (name, sorted(apps))).fetchall()
                counts = {r[0]: r[1] for r in rows}
                for app in apps:
                    conns[app].append(counts.get(app, 0))
                listening.append(sum(r[2] for r in rows))
                samples += 1
                row = conn.execute("SELECT finished_at FROM outbox.housekeeping").fetchone()
                finished.add(row[0] if row else None)
                time.sleep(1.0)
            t1 = time.time()
            pss1 = pss_calls(conn)
            held = owners(conn)
            idle_s = t1 - t0
            idle = pss_delta(pss0, pss1, named)
            stmts = [s for s in read_log(pg.log_path, offset, apps) if t0 <= s[0] < t1]
            per_relay = Counter(app for _, app, _ in stmts)
            empty_per_relay = Counter(app for _, app, text in stmts if not text.strip())
            by_label = Counter(label_statement(text, purposes) for _, _, text in stmts)
            out["idle"] = {
                "seconds": idle_s,
                "pss_statements_per_relay_s": sum(idle.values()) / n / idle_s,
                "pss_by_query_per_relay_s": {k: v / n / idle_s for k, v in idle.most_common()},
                # Per relay: the mean is what the fleet costs (one relay also runs the housekeeping
                # passes), the median what a typical relay sends.
                "log_statements_per_relay_s": spread([(per_relay[x] - empty_per_relay[x]) / idle_s for x in apps]),
                "log_pool_checks_per_relay_s": spread([empty_per_relay[x] / idle_s for x in apps]),
                "log_by_statement_per_relay_s": {k: v / n / idle_s for k, v in by_label.most_common()},
                "housekeeping_passes_per_s": (idle.get("housekeeping.mark_dead_workers", 0)) / idle_s,
                "housekeeping_claims_per_s": (idle.get("housekeeping.claim", 0)) / idle_s,
                "housekeeping_finished_changes_per_s": max(0, len(finished) - 1) / idle_s,
                "connections_per_relay": {
                    "median": statistics.median(statistics.median(v) for v in conns.values()),
                    "max_of_medians": max(statistics.median(v) for v in conns.values()),
                    "max": max(max(v) for v in conns.values()),
                    "relays_with_more_than_2_at_the_end": sum(1 for v in conns.values() if v[-1] > 2),
                    "listen_per_relay": statistics.median(listening) / n,
                    "total_at_the_end": sum(v[-1] for v in conns.values()), "samples": samples},
                "balance": balance(held, ids),
            }
            i = out["idle"]
            log(f"fleet {n} idle: {i['pss_statements_per_relay_s']:.2f} statements/s per relay (pg_stat_statements), "
                f"{i['log_statements_per_relay_s']['mean']:.2f} (log) + {i['log_pool_checks_per_relay_s']['mean']:.2f} "
                f"pool checks; housekeeping {i['housekeeping_passes_per_s']:.2f} passes/s; connections per relay "
                f"{i['connections_per_relay']}; balance {i['balance']}")

            # -- single-event commits ----------------------------------------------------------
            outbox = Outbox(default_topic=topic)
            offset = pg.log_path.stat().st_size
            held = owners(conn)
            commits: list[float] = []
            keys = [f"single:{run}:{k}" for k in range(a.fleet_commits)]
            with psycopg.connect(admin_dsn, application_name="outbox-bench producer") as prod:
                for key in keys:
                    outbox.publish(prod, type="bench.single", key=key, payload={"key": key})
                    if a.fleet_wake_all:  # diagnostic: a payload every relay wakes on, as before 0007
                        prod.execute("SELECT pg_notify('outbox_events_v2', 'all')")
                    prod.commit()
                    commits.append(time.time())
                    time.sleep(a.fleet_commit_gap)
                targets = bench.targets(prod)
            bench.wait_delivered(conn, targets, relays, timeout=60)
            time.sleep(a.fleet_wake_window)
            bucket_of = dict(conn.execute(
                "SELECT partition_key, bucket FROM outbox.events WHERE partition_key = ANY(%s)", (keys,)).fetchall())
            owner_of = [application_name(held[bucket_of[key]] or "") for key in keys]
            # Every relay polls now and then anyway; a poll comes at least 0.8 x its idle poll interval
            # after the relay's previous cycle ended. So a relay's first fetch_events after a commit
            # that follows its previous one sooner than that was woken; one that follows later may
            # have been woken or may be a poll. The bucket's owner is always woken: the share of
            # commits after which it shows as woken is the share of wake-ups this test sees, and the
            # other relays seen woken are divided by it.
            min_gap = 0.75 * idle_poll_seconds(conn, ids, a.relay_args)
            history: dict[str, list[float]] = defaultdict(list)  # relay -> its fetch_events, in time order
            for ts, app, text in read_log(pg.log_path, idle_offset, apps):
                if label_statement(text, purposes) == "relay.fetch_events":
                    history[app].append(ts)
            w = a.fleet_wake_window
            seen: list[set[str]] = []  # per commit: relays that ran fetch_events within w after it
            woken: list[set[str]] = []  # ... of which sooner than a poll could have come
            owner_fetches: list[int] = []
            for c, owner in zip(commits, owner_of, strict=True):
                seen.append(set())
                woken.append(set())
                for app, times in history.items():
                    i = bisect.bisect_right(times, c)
                    if i < len(times) and times[i] <= c + w:
                        seen[-1].add(app)
                        if i > 0 and times[i] - times[i - 1] < min_gap:
                            woken[-1].add(app)
                owner_fetches.append(sum(1 for t in history.get(owner, []) if c < t <= c + w))
            detected = statistics.mean(o in x for o, x in zip(owner_of, woken, strict=True))
            others = statistics.mean(len(x - {o}) for o, x in zip(owner_of, woken, strict=True))
            others_woken = others / detected if detected else None
            owner_share = statistics.mean(o in x for o, x in zip(owner_of, seen, strict=True))
            out["commits"] = {
                "commits": len(commits), "gap_seconds": a.fleet_commit_gap, "window_ms": 1000 * w,
                "min_poll_gap_s": min_gap,
                "owner_fetched_share": owner_share,
                "owner_seen_woken_share": detected,
                "others_seen_woken_per_commit": others,
                "others_woken_per_commit": others_woken,
                "woken_relays_per_commit": None if others_woken is None else owner_share + others_woken,
                # The issue counted fetch_events per commit: the owner's (the read that finds the event,
                # then one that finds nothing more) and one per other relay woken.
                "fetch_events_per_commit": None if others_woken is None
                else statistics.mean(owner_fetches) + others_woken,
                "relays_fetching_within_window": statistics.mean(len(x) for x in seen),
            }
            c = out["commits"]
            log(f"fleet {n} single-event commits: the bucket's owner ran fetch_events within {1000 * w:.0f} ms after "
                f"{100 * owner_share:.0f}% of commits, seen woken (sooner than a poll) after {100 * detected:.0f}%; "
                f"other relays seen woken {others:.2f} per commit, so about {others_woken or 0:.2f} woken; "
                f"{c['woken_relays_per_commit'] or 0:.2f} relays and {c['fetch_events_per_commit'] or 0:.2f} "
                "fetch_events per commit")

            # -- hand-over: one joins, then one leaves ------------------------------------------
            t_spawn = time.time()
            relays += bench.start_relays(1, relay_dsn, topic, f"fleet{n}r{run}-join")
            joiner = relays[-1][0]
            with_joiner = [*ids, joiner]
            owners_before = owners(conn)
            j = wait_assignment(conn, with_joiner, relays, a.fleet_start_timeout, registered=joiner)
            owners_joined = owners(conn)
            leaver_id, leaver = relays[0]
            t_sig = time.time()
            leaver.send_signal(signal.SIGTERM)
            rest = [r for r in relays if r[0] != leaver_id]
            lv = wait_assignment(conn, with_joiner[1:], rest, a.fleet_start_timeout)
            leaver.wait(60)
            owners_final = owners(conn)
            out["handover"] = {
                "join_from_spawn_s": j["settled"] - t_spawn,
                "join_from_registration_s": j["settled"] - j["registered"] if "registered" in j else None,
                "join_moved_buckets": sum(1 for b in owners_before if owners_before[b] != owners_joined[b]),
                "leave_s": lv["settled"] - t_sig,
                "leave_moved_buckets": sum(1 for b in owners_joined if owners_joined[b] != owners_final[b]),
                "leaver_exit_code": leaver.returncode,
            }
            h = out["handover"]
            log(f"fleet {n} hand-over: join {h['join_from_spawn_s']:.1f}s from spawn "
                f"({h['join_from_registration_s'] or 0:.1f}s from its first heartbeat, {h['join_moved_buckets']} "
                f"buckets moved), leave {h['leave_s']:.1f}s ({h['leave_moved_buckets']} moved)")
            out["peak_rss_mb"] = max(bench.peak_rss_mb(p.pid) or 0 for _, p in relays[1:])
    finally:
        bench.stop_relays(relays)
        pg.drop_database(name)
    return out


def case_fleet(bench: Bench) -> None:
    pg = start_server(bench.base)
    runs = []
    try:
        for run in range(bench.args.fleet_runs):
            for n in bench.args.fleet_sizes:
                runs.append(fleet_once(bench, pg, n, run))
    finally:
        pg.stop()
    bench.results["fleet"] = runs
