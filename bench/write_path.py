"""Write path: what publishing costs a business transaction (issue 14, goals 1, 2 and 4).

    python bench/write_path.py              # about 8 minutes on 2 cores: 1/4/16/64 producers, 3 runs
    python bench/write_path.py --quick      # about a minute: 1 s points, 1/16/64 producers, 1 run
    python bench/run.py --cases write       # the same case from the main bench (its --runs and --quick)

One-row business transactions back to back from P producers (threads spread over --write-procs
processes, one connection each): BEGIN, INSERT one row into ``orders``, the outbox write, COMMIT.
Each transaction's latency is timed from before BEGIN to COMMIT's return, as the application sees it.
The outbox write of each case (bench/README.md, "Write path"):

    a  none: the business row alone (the floor)
    b  plain INSERT of the event row into ``bench_bare``: the events table's columns, no index at all
    c  plain INSERT into ``bench_indexed`` = (LIKE outbox.events INCLUDING ALL): all its indexes, no trigger
    d  plain ``INSERT INTO outbox.events (...) VALUES (...)``: the SQL path of other languages
    e  ``Outbox.publish(conn, ...)``: the product
    f  c plus ``pg_notify`` in the same statement: what a NOTIFY costs
    c_key, d_key, e_key: c, d and e with an idempotency key per event (c: ON CONFLICT ... DO NOTHING)

Cases run interleaved (every case at every P in run 1, then run 2, ...; the case order rotates per
run), so load from outside the bench skews them alike and the ratios compare points made side by
side. Then bulk: 100-event transactions from 4 producer processes with ``Outbox.publish_many``, a
plain INSERT ... SELECT FROM unnest into ``bench_indexed``, and COPY into it (the ceiling); and a
py-spy profile of one producer's publish_many, per event.

The tables are emptied before each point, so every point starts from the same state.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

warnings.filterwarnings("ignore", module="platformdirs")

import cpu  # noqa: E402
import psycopg  # noqa: E402
from psycopg import sql as pgsql  # noqa: E402
from servers import Postgres, busy_fraction, machine  # noqa: E402

from outbox_relay import Outbox, migrate  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TOPIC = "orders"
TYPE = "order.placed"
SINGLE_CASES = ("a", "b", "c", "d", "e", "f", "c_key", "d_key", "e_key")
BULK_MODES = ("publish_many", "unnest", "unnest_binary", "json_rows", "copy", "copy_events", "copy_leaf",
              "publish_many_keyed", "unnest_keyed")
LABELS = {
    "a": "a. business row only (floor)",
    "b": "b. + INSERT into bare table (no index)",
    "c": "c. + INSERT into copy with the events indexes",
    "d": "d. + INSERT INTO outbox.events (SQL path)",
    "e": "e. + Outbox.publish",
    "f": "f. c + pg_notify",
    "c_key": "c + idempotency key (ON CONFLICT DO NOTHING)",
    "d_key": "d + idempotency key (a taken key skipped by the trigger)",
    "e_key": "e + idempotency key",
    "publish_many": "Outbox.publish_many",
    "unnest": "INSERT ... SELECT FROM unnest into c",
    "unnest_binary": "the same, arrays sent in binary",
    "json_rows": "INSERT ... SELECT FROM jsonb_to_recordset into c (one JSON parameter)",
    "copy": "COPY into c (ceiling)",
    "copy_events": "COPY into outbox.events (trigger, two routing levels)",
    "copy_leaf": "COPY into the leaf partition directly (trigger, no routing; leaf looked up per transaction)",
    "publish_many_keyed": "Outbox.publish_many, an idempotency key per event",
    "unnest_keyed": "INSERT ... SELECT FROM unnest ... ON CONFLICT DO NOTHING into the copy (a key per event)",
}
# The case each ratio compares with, and the goal (issue 14 goal 1; f/c: goal 2, NOTIFY under 5%).
RATIOS = (("e", "c", 0.8, 1.2), ("d", "c", 0.8, 1.2), ("e_key", "c_key", 0.8, 1.2), ("d_key", "c_key", 0.8, 1.2),
          ("f", "c", 0.95, None), ("c", "b", None, None))

SCHEMA = """
CREATE TABLE orders (id bigserial PRIMARY KEY, note text NOT NULL);
-- b: the events table's columns (defaults, identity and the generated bucket, so the INSERT is the
-- same statement), no index, no CHECK, no trigger.
CREATE TABLE bench_bare (LIKE outbox.events INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING GENERATED);
-- c: everything but the triggers (LIKE never copies triggers): the indexes the relay's reads,
-- retention and idempotency need, as the current schema has them.
CREATE TABLE bench_indexed (LIKE outbox.events INCLUDING ALL);
-- Since outbox.events is partitioned (0014) its idempotency keys live in outbox.idempotency_keys;
-- the plain table keeps the unique index a one-table outbox would have (partial: keyless rows skip it).
CREATE UNIQUE INDEX bench_indexed_key ON bench_indexed ((coalesce(topic, '')), idempotency_key)
    WHERE idempotency_key IS NOT NULL;
"""

INSERT_ORDER = "INSERT INTO orders (note) VALUES (%s)"
COLUMNS = "topic, partition_key, type, payload"
INSERT_BARE = f"INSERT INTO bench_bare ({COLUMNS}) VALUES (%s, %s, %s, %s)"
INSERT_INDEXED = f"INSERT INTO bench_indexed ({COLUMNS}) VALUES (%s, %s, %s, %s)"
INSERT_EVENTS = f"INSERT INTO outbox.events ({COLUMNS}) VALUES (%s, %s, %s, %s)"
# The idempotency index of outbox.events (and of its copy): what docs/sql-producers.md tells SQL producers.
ON_KEY = "ON CONFLICT ((coalesce(topic, '')), idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING"
INSERT_INDEXED_KEY = f"INSERT INTO bench_indexed ({COLUMNS}, idempotency_key) VALUES (%s, %s, %s, %s, %s) {ON_KEY}"
# The SQL path with a key since 0014: no ON CONFLICT (the events_check trigger skips a taken key).
INSERT_EVENTS_KEY = f"INSERT INTO outbox.events ({COLUMNS}, idempotency_key) VALUES (%s, %s, %s, %s, %s)"
# One statement, as the events table's trigger did it: no extra round trip, only the NOTIFY.
INSERT_NOTIFY = (f"WITH e AS (INSERT INTO bench_indexed ({COLUMNS}) VALUES (%s, %s, %s, %s) RETURNING bucket) "
                 "SELECT pg_notify('bench_write_path', bucket::text) FROM e")
INSERT_UNNEST = (f"INSERT INTO bench_indexed ({COLUMNS}) "
                 "SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::jsonb[])")
INSERT_UNNEST_BINARY = INSERT_UNNEST.replace("%s", "%b")  # psycopg: send this parameter in binary
# The keyed bulk baseline (issue 27, goal 5): the same batch, each event with its own idempotency key, into
# the copy with the events table's unique key index, a taken key skipped.
INSERT_UNNEST_KEYED = (f"INSERT INTO bench_indexed ({COLUMNS}, idempotency_key) "
                       "SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::jsonb[], %s::text[]) " + ON_KEY)
# The batch as one JSON document: json.dumps is C, where psycopg escapes every quote of every array
# element in Python when it sends text[] in text format.
INSERT_JSON_ROWS = (f"INSERT INTO bench_indexed ({COLUMNS}) SELECT {COLUMNS} FROM jsonb_to_recordset(%s::jsonb) "
                    "AS r(topic text, partition_key text, type text, payload jsonb)")
COPY_INDEXED = f"COPY bench_indexed ({COLUMNS}) FROM STDIN"
COPY_EVENTS = f"COPY outbox.events ({COLUMNS}) FROM STDIN"
# copy_leaf: the leaf that holds this transaction's rows, looked up in the transaction (which takes its
# xid): the default class's leaf of the range holding the xid, else the DEFAULT range partition. A leaf
# picked once per point went stale as soon as the xid ranges moved on under it, and the COPY failed; a
# producer that writes to a leaf directly has to do the same. PostgreSQL 17 or later: before, a leaf has no
# identity of its own (seq comes from outbox.events' identity), so a COPY into it fails on seq.
COPY_LEAF = "COPY {} (" + COLUMNS + ") FROM STDIN"
LEAF = ("SELECT coalesce((SELECT p.name FROM outbox.partitions p WHERE p.range_name IS NOT NULL "
        "AND p.class = 'default' AND p.xid_from <= pg_current_xact_id() AND pg_current_xact_id() < p.xid_to), "
        "'events_default')")


def log(msg: str) -> None:  # as run.log (run.py is __main__: importing it would load it twice)
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(p: float, xs: Sequence[float]) -> float | None:
    """The p-th percentile of sorted values (nearest rank), None if there are none."""
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else None


# -- the producers (worker processes) ------------------------------------------------------------


class Events:
    """One producer thread's events: a key of ``keys``, a payload of about 200 bytes of JSON."""

    def __init__(self, tag: str, keys: int) -> None:
        self.tag = tag
        self.keys = keys
        self.rng = random.Random(tag)
        self.n = 0

    def next(self) -> tuple[str, dict[str, Any], str]:
        self.n += 1
        customer = self.rng.randrange(self.keys)
        payload = {"order_id": f"{self.tag}-{self.n}", "customer_id": customer, "currency": "EUR",
                   "amount_cents": self.rng.randrange(100, 100_000), "status": "placed",
                   "lines": [{"sku": f"SKU-{self.rng.randrange(10_000):05d}", "qty": self.rng.randrange(1, 5)}
                             for _ in range(2)],
                   "placed_at": "2026-11-26T10:15:00Z"}
        return f"customer:{customer}", payload, f"{self.tag}-{self.n}"


def one_row_tx(case: str, outbox: Outbox) -> Callable[[psycopg.Connection[Any], Events], int]:
    """The transaction of one case: BEGIN (sent by psycopg before the first statement), the business
    row, the outbox write, COMMIT. Returns the events it wrote."""

    def tx(conn: psycopg.Connection[Any], ev: Events) -> int:
        key, payload, ikey = ev.next()
        conn.execute(INSERT_ORDER, (f"order {ikey} for {key}",))
        if case == "e":
            outbox.publish(conn, type=TYPE, key=key, payload=payload, topic=TOPIC)
        elif case == "e_key":
            outbox.publish(conn, type=TYPE, key=key, payload=payload, topic=TOPIC, idempotency_key=ikey)
        elif case != "a":
            sql, with_key = {"b": (INSERT_BARE, False), "c": (INSERT_INDEXED, False), "d": (INSERT_EVENTS, False),
                             "f": (INSERT_NOTIFY, False), "c_key": (INSERT_INDEXED_KEY, True),
                             "d_key": (INSERT_EVENTS_KEY, True)}[case]
            params: tuple[Any, ...] = (TOPIC, key, TYPE, json.dumps(payload))
            conn.execute(sql, (*params, ikey) if with_key else params)
        conn.commit()
        return 0 if case == "a" else 1

    return tx


def bulk_tx(mode: str, outbox: Outbox, size: int) -> Callable[[psycopg.Connection[Any], Events], int]:
    """A transaction of ``size`` events and no business row."""

    def tx(conn: psycopg.Connection[Any], ev: Events) -> int:
        rows = [ev.next() for _ in range(size)]
        if mode == "publish_many":
            outbox.publish_many(conn, [{"type": TYPE, "key": k, "payload": p, "topic": TOPIC} for k, p, _ in rows])
        elif mode == "publish_many_keyed":
            outbox.publish_many(conn, [{"type": TYPE, "key": k, "payload": p, "topic": TOPIC, "idempotency_key": i}
                                       for k, p, i in rows])
        elif mode == "unnest_keyed":
            conn.execute(INSERT_UNNEST_KEYED, ([TOPIC] * size, [k for k, _, _ in rows], [TYPE] * size,
                                               [json.dumps(p) for _, p, _ in rows], [i for _, _, i in rows]))
        elif mode in ("unnest", "unnest_binary"):
            conn.execute(INSERT_UNNEST if mode == "unnest" else INSERT_UNNEST_BINARY,
                         ([TOPIC] * size, [k for k, _, _ in rows], [TYPE] * size, [json.dumps(p) for _, p, _ in rows]))
        elif mode == "json_rows":
            conn.execute(INSERT_JSON_ROWS, (json.dumps([{"topic": TOPIC, "partition_key": k, "type": TYPE, "payload": p}
                                                        for k, p, _ in rows]),))
        else:
            statement: Any = COPY_INDEXED if mode == "copy" else COPY_EVENTS
            if mode == "copy_leaf":
                leaf = conn.execute(LEAF).fetchone()[0]  # type: ignore[index]
                statement = pgsql.SQL(COPY_LEAF).format(pgsql.Identifier("outbox", leaf))
            with conn.cursor() as cur, cur.copy(statement) as copy:
                for k, p, _ in rows:
                    copy.write_row((TOPIC, k, TYPE, json.dumps(p)))
        conn.commit()
        return size

    return tx


def run_job(job: dict[str, Any], control: Any) -> dict[str, Any]:
    """Open the job's connections, say ``ready``, wait for ``{"go": t0}``, then run transactions back to
    back on every connection from t0 to the end of the window. A transaction counts when its COMMIT
    returned inside the window [t0 + warmup, t0 + warmup + seconds). The connections close on ``end``."""
    outbox = Outbox(default_topic=TOPIC)
    op = job["case"]
    tx = bulk_tx(op, outbox, job["tx_size"]) if op in BULK_MODES else one_row_tx(op, outbox)
    conns = [psycopg.connect(job["dsn"], application_name="bench-write") for _ in range(job["threads"])]
    print("ready", flush=True)
    go = json.loads(control.readline())
    t0 = go["go"]
    lo = t0 + job["warmup"]
    hi = lo + job["seconds"]
    latencies: list[list[float]] = [[] for _ in conns]
    counts = [0] * len(conns)
    txs = [0] * len(conns)
    errors: list[str] = []

    def producer(i: int) -> None:
        conn = conns[i]
        ev = Events(f"{job['tag']}-{i}", job["keys"])
        mine = latencies[i]
        time.sleep(max(0.0, t0 - time.time()))
        try:
            while time.time() < hi:
                start = time.perf_counter()
                n = tx(conn, ev)
                took = time.perf_counter() - start
                done = time.time()
                if lo <= done < hi:
                    mine.append(took * 1000.0)
                    counts[i] += n
                    txs[i] += 1
        except Exception as exc:  # reported to the parent, which stops the bench
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=producer, args=(i,), daemon=True) for i in range(len(conns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    control.readline()  # "end": the parent has read the window's CPU, the sessions' included
    for conn in conns:
        conn.close()
    return {"transactions": sum(txs), "events": sum(counts), "latencies_ms": [x for xs in latencies for x in xs],
            "errors": errors[:5]}


def worker_main() -> None:
    """``write_path.py worker``: run the jobs given on stdin, one JSON line each, until end of input."""
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        result = run_job(json.loads(line), sys.stdin)
        print(json.dumps(result), flush=True)


# -- the parent: points, runs, the table ------------------------------------------------------------


class HasPostgres(Protocol):
    """What case_write needs of run.py's Bench (or of the standalone runner)."""

    args: argparse.Namespace
    results: dict[str, Any]

    @property
    def pg(self) -> Postgres: ...


class Producers:
    """--write-procs long-lived worker processes; a point with P producers gives them P threads round robin."""

    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "worker"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(n)]

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                assert p.stdin is not None
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def point(self, pg_root: Path, job: dict[str, Any], producers: int) -> dict[str, Any]:
        """Run one point: ``producers`` threads over the workers, started together; CPU per group over
        the window (each worker, the PostgreSQL server, the whole machine)."""
        share = [producers // len(self.procs) + (1 if i < producers % len(self.procs) else 0)
                 for i in range(len(self.procs))]
        used = [(p, k) for p, k in zip(self.procs, share, strict=True) if k]
        for i, (p, k) in enumerate(used):
            assert p.stdin is not None
            p.stdin.write(json.dumps({**job, "threads": k, "tag": f"{job['tag']}-{i}"}) + "\n")
            p.stdin.flush()
        for p, _ in used:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"write-path producer process did not start the point ({line!r})")
        t0 = time.time() + 0.05
        for p, _ in used:
            assert p.stdin is not None
            p.stdin.write(json.dumps({"go": t0}) + "\n")
            p.stdin.flush()
        postmaster = cpu.postmaster_pid(pg_root)

        def pids(pid: int | None, with_children: bool = False) -> Callable[[], Iterable[int]]:
            return lambda: ([pid, *cpu.children(pid)] if with_children else [pid]) if pid else []

        groups = {f"producer process {i}": pids(p.pid) for i, (p, _) in enumerate(used)}
        groups["postgres"] = pids(postmaster, with_children=True)
        window = cpu.CpuWindow(groups)
        time.sleep(max(0.0, t0 + job["warmup"] - time.time()))
        window.start()
        time.sleep(max(0.0, t0 + job["warmup"] + job["seconds"] - time.time()))
        shares = window.stop()
        for p, _ in used:  # their sessions stay open until now: a backend that ended would read as 0 s of CPU
            assert p.stdin is not None
            p.stdin.write("end\n")
            p.stdin.flush()
        reports = []
        for p, _ in used:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"write-path producer process exited with {p.poll()}")
            reports.append(json.loads(line))
        errors = [e for r in reports for e in r["errors"]]
        if errors:
            raise RuntimeError(f"write path {job['case']} with {producers} producers: {errors[0]}")
        lat = sorted(x for r in reports for x in r["latencies_ms"])
        client = [v for k, v in shares.items() if k.startswith("producer process")]
        seconds = job["seconds"]
        return {"case": job["case"], "producers": producers, "processes": len(used),
                "tx_per_s": sum(r["transactions"] for r in reports) / seconds,
                "events_per_s": sum(r["events"] for r in reports) / seconds,
                "p50_ms": pct(50, lat), "p99_ms": pct(99, lat), "max_ms": lat[-1] if lat else None,
                "client_cores": sum(client), "client_max_process_cores": max(client, default=0.0),
                "postgres_cores": shares.get("postgres"), "machine_cores": shares.get("machine"),
                "other_cores": shares.get("other")}


def catalog(dsn: str) -> dict[str, Any]:
    """What the cases write to, read from the catalog so the table stays true as the schema changes."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        indexes = {t: [r[0] for r in conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE schemaname || '.' || tablename = %s ORDER BY indexname", (t,))]
            for t in ("public.bench_bare", "public.bench_indexed", "outbox.events")}
        triggers = [f"{r[0]} ({r[1]})" for r in conn.execute(
            "SELECT tgname, CASE WHEN tgtype & 2 = 2 THEN 'BEFORE' ELSE 'AFTER' END || ' INSERT, FOR EACH ' "
            "|| CASE WHEN tgtype & 1 = 1 THEN 'ROW' ELSE 'STATEMENT' END "
            "FROM pg_trigger WHERE tgrelid = 'outbox.events'::regclass AND NOT tgisinternal AND tgtype & 4 = 4 "
            "AND tgenabled <> 'D' ORDER BY tgname")]
        checks = [r[0] for r in conn.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = 'public.bench_indexed'::regclass AND contype = 'c' "
            "ORDER BY conname")]
        settings = {name: str(conn.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
                    for name in ("server_version", "fsync", "synchronous_commit", "wal_sync_method", "full_page_writes",
                                 "shared_buffers", "max_connections", "commit_delay")}
        row = conn.execute("SELECT version || ' ' || name FROM outbox.schema_migrations ORDER BY version DESC "
                           "LIMIT 1").fetchone()
    return {"indexes": indexes, "events_insert_triggers": triggers, "checks": checks, "settings": settings,
            "last_migration": row[0] if row else None}


def code_version() -> str:
    """The commit measured, and whether the package or its SQL had uncommitted changes (a before/after
    of a change in progress)."""
    root = HERE.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "outbox_relay", "sql"],
                               capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head}" + (f" with {len(dirty)} uncommitted files under outbox_relay/ and sql/" if dirty else "")


def empty_tables(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE orders, bench_bare, bench_indexed, outbox.events, outbox.idempotency_keys")


def profile_loop(dsn: str, seconds: float, tx_size: int, keys: int) -> dict[str, Any]:
    """One producer's publish_many of ``tx_size``-event transactions, back to back for ``seconds``
    (run under py-spy by ``profile_publish_many``; its name marks the samples that count)."""
    outbox = Outbox(default_topic=TOPIC)
    tx = bulk_tx("publish_many", outbox, tx_size)
    ev = Events("profile", keys)
    events = 0
    with psycopg.connect(dsn, application_name="bench-write") as conn:
        tx(conn, ev)  # connection warm, statement cached as usual
        cpu0 = time.process_time()
        wall0 = time.perf_counter()
        while time.perf_counter() - wall0 < seconds:
            events += tx(conn, ev)
        wall = time.perf_counter() - wall0
        cpu_s = time.process_time() - cpu0
    return {"events": events, "seconds": wall, "cpu_seconds": cpu_s}


def _frame(frame: str) -> str:
    """py-spy's 'func (path/file.py:123)' -> 'func (dir/file.py)'."""
    name, _, where = frame.partition(" (")
    path = where.split(":")[0]
    return f"{name} ({'/'.join(path.rsplit('/', 2)[-2:])})" if where else name


def profile_publish_many(dsn: str, seconds: float, tx_size: int, keys: int, raw: Path) -> dict[str, Any] | None:
    """Where one publish_many producer's wall time goes, per event: ``profile_loop`` in a process of its
    own under ``py-spy record --idle`` (waiting on the server counts, as psycopg's wait). Sampling, not
    tracing: cProfile's per-call cost inflated small functions (a payload depth check, dict.values)
    several times here. None if py-spy is not installed."""
    import shutil

    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        log("write profile skipped: py-spy is not installed (pip install py-spy)")
        return None
    figures = raw.with_suffix(".json")
    subprocess.run(
        [spy, "record", "--idle", "--rate", "500", "--format", "raw", "--output", str(raw), "--",
         sys.executable, str(Path(__file__).resolve()), "profile", dsn, str(seconds), str(tx_size), str(keys),
         str(figures)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=seconds + 120, check=True)
    done = json.loads(figures.read_text())
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if "profile_loop (" not in stack:
            continue  # start-up: imports, connecting
        count = int(count_s)
        frames = [_frame(f) for f in stack.split(";")]
        frames = frames[next(i for i, f in enumerate(frames) if f.startswith("profile_loop (")) + 1:]
        if not frames:
            continue
        total += count
        for key in {f for f in frames if not f.endswith("(write_path.py)")}:  # the bench's own loop: everything
            inclusive[key] = inclusive.get(key, 0) + count
        own[frames[-1]] = own.get(frames[-1], 0) + count
    us = done["seconds"] / done["events"] * 1e6  # wall time per event

    def per_event(d: dict[str, int]) -> list[dict[str, Any]]:
        ranked = sorted(d.items(), key=lambda kv: -kv[1])[:15]
        return [{"function": k, "us_per_event": us * v / total, "share": v / total} for k, v in ranked] if total else []

    return {"events": done["events"], "events_per_s": done["events"] / done["seconds"], "wall_us_per_event": us,
            "cpu_us_per_event": done["cpu_seconds"] / done["events"] * 1e6, "samples": total, "raw": str(raw),
            "top_self": per_event(own), "top_inclusive": per_event(inclusive)}


def case_write(bench: HasPostgres) -> None:
    """The write-path case: every point of every run, interleaved; results in bench.results["write"]."""
    a = bench.args
    pg = bench.pg
    name = pg.create_database("write")
    dsn = pg.dsn(name)
    producers = Producers(a.write_procs)
    out: dict[str, Any] = {"points": [], "bulk": [], "args": {
        "producers": a.write_producers, "cases": a.write_cases, "seconds": a.write_seconds,
        "warmup": a.write_warmup, "runs": a.write_runs, "procs": a.write_procs, "keys": a.keys,
        "bulk_producers": a.write_bulk_producers, "bulk_tx_size": a.write_bulk_tx_size}}
    bench.results["write"] = out
    try:
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SCHEMA)
        out["catalog"] = catalog(dsn)
        out["code"] = code_version()
        base = {"dsn": dsn, "warmup": a.write_warmup, "seconds": a.write_seconds, "keys": a.keys, "tx_size": 1}
        for run in range(a.write_runs):
            order = list(a.write_cases)
            shift = run % len(order)
            order = order[shift:] + order[:shift]  # no case always runs first, or right after the same one
            for p_n in a.write_producers:
                for case in order:
                    empty_tables(dsn)
                    r = producers.point(pg.dir, {**base, "case": case, "tag": f"{case}{p_n}r{run}"}, p_n)
                    r["run"] = run
                    out["points"].append(r)
                    log(f"write {case} {p_n} producers run {run + 1}: {r['tx_per_s']:,.0f} tx/s, p50 "
                        f"{r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms; cores: producers {r['client_cores']:.2f} "
                        f"(max process {r['client_max_process_cores']:.2f}), postgres {r['postgres_cores']:.2f}, "
                        f"machine {r['machine_cores']:.2f}")
            for mode in (a.write_bulk_modes.split(",") if a.write_bulk_producers else ()):
                empty_tables(dsn)
                job = {**base, "case": mode, "tag": f"{mode}r{run}", "tx_size": a.write_bulk_tx_size}
                r = producers.point(pg.dir, job, a.write_bulk_producers)
                r["run"] = run
                out["bulk"].append(r)
                log(f"write bulk {mode} {a.write_bulk_producers} producers run {run + 1}: {r['events_per_s']:,.0f} "
                    f"ev/s; cores: producers {r['client_cores']:.2f}, postgres {r['postgres_cores']:.2f}")
        if a.write_profile_seconds > 0:
            empty_tables(dsn)
            raw = RESULTS / f"write-profile-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.txt"
            prof = out["profile"] = profile_publish_many(dsn, a.write_profile_seconds, a.write_bulk_tx_size, a.keys,
                                                         raw)
            if prof:
                log(f"write profile: publish_many {prof['events_per_s']:,.0f} ev/s on one connection under py-spy, "
                    f"{prof['cpu_us_per_event']:.1f} us of client CPU per event; raw stacks in {raw}")
    finally:
        producers.close()
        pg.drop_database(name)


# -- the report -------------------------------------------------------------------------------------


def _med(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _cell(xs: Sequence[float | None], fmt: str) -> str:
    vals = [x for x in xs if x is not None]
    if not vals:
        return "-"
    m = format(statistics.median(vals), fmt)
    return m if len(vals) == 1 else f"{m} ({format(min(vals), fmt)}-{format(max(vals), fmt)})"


def report(meta: dict[str, Any], w: dict[str, Any]) -> str:
    """The Markdown tables of the write case (every figure: median over runs, min-max of the runs)."""
    args = w["args"]
    points = w["points"]
    cat = w.get("catalog", {})
    ps = args["producers"]
    cases = [c for c in SINGLE_CASES if c in args["cases"]]
    m = meta.get("machine", {})
    st = cat.get("settings", {})
    lines = [
        f"### Write path: one-row business transactions (median of {args['runs']} interleaved runs, min-max)",
        "",
        f"Machine: {m.get('cores')} cores ({m.get('cpu', '?')}), {m.get('ram_gib', '?')} GiB, Python "
        f"{m.get('python', '?')}; PostgreSQL {st.get('server_version', '?')}: " + ", ".join(
            f"{k} {v}" for k, v in st.items() if k != "server_version") + ".",
        f"Each point: {args['warmup']} s warm-up, then {args['seconds']} s measured; P producer threads over "
        f"{args['procs']} processes, one connection each; keys from {args['keys']:,}; payload about 200 bytes "
        "of JSON; tables emptied before each point.",
        f"Code: {w.get('code', '?')}; schema: migrations up to {cat.get('last_migration') or '?'}. Triggers on "
        "INSERT into outbox.events (in d and e): " + (", ".join(cat.get("events_insert_triggers", [])) or "none") + ".",
        "Indexes of c (`LIKE outbox.events INCLUDING ALL`): " + "; ".join(
            f"`{d.split(' USING ', 1)[-1]}`" for d in cat.get("indexes", {}).get("public.bench_indexed", []))
        + f"; CHECK constraints: {', '.join(cat.get('checks', [])) or 'none'}. b has "
        f"{len(cat.get('indexes', {}).get('public.bench_bare', []))} indexes.",
        "",
        "Transactions/s:",
        "",
        "| case | " + " | ".join(f"P={p}" for p in ps) + " |",
        "|---|" + "---:|" * len(ps),
    ]

    def at(case: str, p: int, run: int | None = None) -> list[dict[str, Any]]:
        return [r for r in points if r["case"] == case and r["producers"] == p and (run is None or r["run"] == run)]

    for c in cases:
        lines.append(f"| {LABELS[c]} | " + " | ".join(_cell([r["tx_per_s"] for r in at(c, p)], ",.0f") for p in ps)
                     + " |")
    lines += ["", "Commit latency p50 / p99 (ms, BEGIN to COMMIT's return):", "",
              "| case | " + " | ".join(f"P={p}" for p in ps) + " |", "|---|" + "---:|" * len(ps)]
    for c in cases:
        lines.append(f"| {LABELS[c]} | " + " | ".join(
            f"{_cell([r['p50_ms'] for r in at(c, p)], '.2f')} / {_cell([r['p99_ms'] for r in at(c, p)], '.1f')}"
            for p in ps) + " |")
    lines += ["", "Ratios, per run then median (min-max); goal from issue 14:", "",
              "| ratio | goal | " + " | ".join(f"P={p}" for p in ps) + " |", "|---|---|" + "---:|" * len(ps)]

    def ratio(num: str, den: str, p: int, key: str) -> list[float | None]:
        out: list[float | None] = []
        for run in range(args["runs"]):
            x, y = at(num, p, run), at(den, p, run)
            if x and y and x[0][key] and y[0][key]:
                out.append(x[0][key] / y[0][key])
        return out

    def verdict(xs: list[float | None], goal: float | None, at_least: bool) -> str:
        med = _med(xs)
        if goal is None or med is None:
            return ""
        return "" if (med >= goal if at_least else med <= goal) else " **missed**"

    for num, den, tx_goal, lat_goal in RATIOS:
        if num not in cases or den not in cases:
            continue
        cells = [ratio(num, den, p, "tx_per_s") for p in ps]
        goal = f">= {tx_goal}" if tx_goal else "-"
        lines.append(f"| {num}/{den} tx/s | {goal} | " + " | ".join(
            _cell(xs, ".2f") + verdict(xs, tx_goal, True) for xs in cells) + " |")
        if lat_goal:
            cells = [ratio(num, den, p, "p50_ms") for p in ps]
            lines.append(f"| {num}/{den} p50 latency | <= {lat_goal} | " + " | ".join(
                _cell(xs, ".2f") + verdict(xs, lat_goal, False) for xs in cells) + " |")
    lines += ["", "CPU over each window in cores (producer processes / the busiest producer process / PostgreSQL "
              "/ everything else on the machine, i.e. other work), median over runs:", "",
              "| case | " + " | ".join(f"P={p}" for p in ps) + " |", "|---|" + "---:|" * len(ps)]
    for c in cases:
        lines.append(f"| {c} | " + " | ".join(
            "/".join(format(_med([r[k] for r in at(c, p)]) or 0.0, ".2f")
                     for k in ("client_cores", "client_max_process_cores", "postgres_cores", "other_cores"))
            for p in ps) + " |")
    lines += ["", "Producer CPU per transaction (us: producer processes' CPU / transactions; the Python and libpq "
              "side of each case), median over runs:", "",
              "| case | " + " | ".join(f"P={p}" for p in ps) + " |", "|---|" + "---:|" * len(ps)]
    for c in cases:
        lines.append(f"| {c} | " + " | ".join(_cell([r["client_cores"] / r["tx_per_s"] * 1e6 for r in at(c, p)
                                                      if r["tx_per_s"]], ".0f") for p in ps) + " |")
    if "c" in cases and "f" in cases and ps:
        top = max(ps)
        c_, f_ = _med([r["tx_per_s"] for r in at("c", top)]), _med([r["tx_per_s"] for r in at("f", top)])
        if c_ and f_:
            lines += ["", f"Commits/s at {top} producers: {c_:,.0f} without NOTIFY (c), {f_:,.0f} with it (f): "
                      f"{100 * (1 - f_ / c_):.0f}% fewer (goal 2: under 5%)."]
    bulk = w.get("bulk", [])
    if bulk:
        lines += ["", f"### Write path: bulk, {args['bulk_tx_size']}-event transactions from "
                  f"{args['bulk_producers']} producer processes (no business row)", "",
                  "| how | events/s | transactions/s | producer CPU per event (us) | cores: producers / postgres "
                  "/ other work |", "|---|---:|---:|---:|---|"]
        for mode in BULK_MODES:
            rs = [r for r in bulk if r["case"] == mode]
            if not rs:
                continue
            per_event = [r["client_cores"] / r["events_per_s"] * 1e6 for r in rs if r["events_per_s"]]
            lines.append(f"| {LABELS[mode]} | {_cell([r['events_per_s'] for r in rs], ',.0f')} | "
                         f"{_cell([r['tx_per_s'] for r in rs], ',.0f')} | {_cell(per_event, '.1f')} | " + "/".join(
                             format(_med([r[k] for r in rs]) or 0.0, ".2f")
                             for k in ("client_cores", "postgres_cores", "other_cores")) + " |")
        pm = _med([r["events_per_s"] for r in bulk if r["case"] == "publish_many"])
        if pm is not None:
            lines += ["", f"Goal 4 (publish_many >= 100,000 events/s): {pm:,.0f}"
                      + (" met." if pm >= 100_000 else " **missed**.")]
    prof = w.get("profile")
    if prof and prof["samples"]:
        lines += ["", f"Profile (py-spy --idle, {prof['samples']:,} samples) of one producer's publish_many "
                  f"({args['bulk_tx_size']} events a transaction, {prof['events_per_s']:,.0f} ev/s on one connection "
                  f"under the profiler): {prof['wall_us_per_event']:.1f} us of wall time and "
                  f"{prof['cpu_us_per_event']:.1f} us of CPU per event. Wall time per event (us) by function, "
                  "including what it called:", ""]
        for r in prof["top_inclusive"][:12]:
            lines.append(f"- {r['us_per_event']:7.2f}  {r['function']}")
        lines += ["", "Innermost frames (where the time is spent):", ""]
        for r in prof["top_self"][:10]:
            lines.append(f"- {r['us_per_event']:7.2f}  {r['function']}")
    return "\n".join(lines)


# -- options (shared with run.py) and the standalone command --------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--write-producers", default=None,
                   help="write: producer counts (default 1,4,16,64; --quick 1,16,64)")
    p.add_argument("--write-cases", default=",".join(SINGLE_CASES),
                   help="write: one-row cases, comma list of a,b,c,d,e,f,c_key,d_key,e_key")
    p.add_argument("--write-seconds", type=float, default=None, help="write: measured seconds per point (default 3)")
    p.add_argument("--write-warmup", type=float, default=None, help="write: seconds before each window (default 0.5)")
    p.add_argument("--write-runs", type=int, default=None, help="write: runs (default --runs)")
    p.add_argument("--write-procs", type=int, default=4, help="write: producer processes the threads are spread over")
    p.add_argument("--write-bulk-producers", type=int, default=4, help="write: bulk producer processes (0: no bulk)")
    p.add_argument("--write-bulk-tx-size", type=int, default=100, help="write: events per bulk transaction")
    p.add_argument("--write-bulk-modes", default=",".join(BULK_MODES),
                   help="write: the bulk writes to run, comma list (publish_many_keyed and unnest_keyed: an "
                        "idempotency key per event)")
    p.add_argument("--write-profile-seconds", type=float, default=None,
                   help="write: py-spy one producer's publish_many this long (default 3, --quick 1; 0: none)")


def finish_arguments(args: argparse.Namespace) -> None:
    quick = args.quick
    args.write_producers = [int(x) for x in (args.write_producers or ("1,16,64" if quick else "1,4,16,64")).split(",")]
    args.write_cases = [c for c in args.write_cases.split(",") if c]
    unknown = [c for c in args.write_cases if c not in SINGLE_CASES]
    if unknown:
        raise SystemExit(f"--write-cases: unknown case {unknown[0]!r} (known: {', '.join(SINGLE_CASES)})")
    args.write_seconds = args.write_seconds or (1.0 if quick else 3.0)
    args.write_warmup = args.write_warmup if args.write_warmup is not None else (0.25 if quick else 0.5)
    args.write_runs = args.write_runs or args.runs
    args.write_profile_seconds = args.write_profile_seconds if args.write_profile_seconds is not None else (
        1.0 if quick else 3.0)


class Standalone:
    """A PostgreSQL server of its own (no broker: nothing here delivers)."""

    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        self.args = args
        self.results: dict[str, Any] = {}
        self.base = base
        self._pg = Postgres(base)

    @property
    def pg(self) -> Postgres:
        return self._pg


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["worker"]:
        worker_main()
        return 0
    if argv is None and sys.argv[1:2] == ["profile"]:
        dsn, seconds, tx_size, keys, figures = sys.argv[2:7]
        Path(figures).write_text(json.dumps(profile_loop(dsn, float(seconds), int(tx_size), int(keys))))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="about a minute: 1 run, 1 s points, 1/16/64 producers")
    p.add_argument("--runs", type=int, default=None, help="runs (default 3, --quick 1)")
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--keep", action="store_true", help="keep the server directory under /tmp")
    add_arguments(p)
    args = p.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 3)
    finish_arguments(args)
    import shutil
    import tempfile

    RESULTS.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now().astimezone()
    base = Path(tempfile.mkdtemp(prefix="outbox-bench-write-", dir="/tmp"))
    t_start = time.monotonic()
    bench = None
    try:
        bench = Standalone(args, base)
        busy = busy_fraction(1.0)
        log(f"PostgreSQL {bench.pg.version} in {base}; machine {100 * busy:.0f}% busy just before, load average "
            f"{os.getloadavg()[0]:.1f}")
        meta: dict[str, Any] = {"started": started.isoformat(timespec="seconds"), "machine": machine(),
                "background_busy": round(busy, 3), "loadavg_before": os.getloadavg()[0],
                "args": {k: v for k, v in vars(args).items()}}
        case_write(bench)
        meta["total_seconds"] = time.monotonic() - t_start
        meta["loadavg_after"] = os.getloadavg()[0]
    finally:
        if bench is not None:
            bench.pg.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    text = report(meta, bench.results["write"])
    out = RESULTS / f"write-{started.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"meta": meta, "results": bench.results, "table": text}, indent=2, default=str))
    print(text)
    print(f"\n(total {meta['total_seconds']:.0f}s, machine {100 * meta['background_busy']:.0f}% busy before; load "
          f"average {meta['loadavg_before']:.1f} before, {meta['loadavg_after']:.1f} after; raw results in "
          f"{out.relative_to(HERE.parent)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
