"""outbox-relay benchmark: one command, its own servers, medians of several runs.

    python bench/run.py                 # the default bench (about 18-20 minutes on 2 cores)
    python bench/run.py --quick         # about 3 minutes: fewer events, runs and history sizes
    python bench/run.py --cases drain,reference --events 50000 --runs 5
    python bench/run.py --cases issue8  # every row of issue 8's table, next to a tuned SQL relay

Cases (bench/README.md explains each one and its caveats):
    drain      N events published first, then 1/2/4 `outbox-relay run` processes deliver them to Kafka
    tuned      a tuned set-based SQL relay (one UPDATE claims 500 and marks them, commit after the acks), same N
    reference  the seed's claim loop (claim 25 with SKIP LOCKED, complete row by row), same N, same servers
               (drain, tuned and reference run interleaved when selected together)
    latency    commit-to-ack latency at 1k and 5k events/s with 1 and 4 relays, ours and the tuned SQL relay
    longtx     the same while a writing transaction stays open on the server, next to a run without one
    idle       1 and 4 relays with nothing to deliver: CPU of relays + their backends, then the first event
               after a quiet spell (idle.py; --idle-baseline DIR: the same for the code exported there)
    fleet      32 and 64 relays on a server of their own: idle statements/s, wake-ups per commit,
               housekeeping passes, connections, bucket balance, hand-over times
    enqueue    4 concurrent producer processes, 1 and 100 events per transaction
    claim      EXPLAIN (ANALYZE, BUFFERS) of the relay's fetch query as stored history grows
    projection as drain (released backlog), with relays that run a projection (one upsert per event)
    rebuild    `outbox-relay rebuild` of that projection over 1M stored events, 1 and 2 processes
    (history    since schema version 14 retention drops partitions: python bench/history.py)
    write      (not in the default set; also `python bench/write_path.py`) one-row business transactions
               from 1/4/16/64 producers with and without the outbox write, bulk publish_many (write_path.py)
Peak RSS of each relay process is read at the end of every drain and projection run.

Prints a Markdown table and writes every raw figure as JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", module="platformdirs")

import cpu  # noqa: E402
import fleet  # noqa: E402
import idle  # noqa: E402
import issue8  # noqa: E402
import projection_cases  # noqa: E402
import psycopg  # noqa: E402
import write_path  # noqa: E402
from servers import Servers, busy_fraction, machine  # noqa: E402

from outbox_relay import Outbox, migrate, positions  # noqa: E402
from outbox_relay import store as relay_store  # noqa: E402
from outbox_relay.wakeups import WATCH_LOCK  # noqa: E402

HERE = Path(__file__).resolve().parent
# What `--cases issue8` runs: every row of issue 8's table (bench/README.md).
ISSUE8_CASES = ("drain", "tuned", "reference", "latency", "longtx", "fleet")
THROUGHPUT_CASES = ("drain", "tuned", "reference")  # run interleaved with each other
RESULTS = HERE / "results"
PROCS = HERE / "procs.py"
SINK = "kafka"
PARTITIONS = 8
# The latency case's relay kinds that run outbox-relay. "notified" is a control, never a product mode:
# the events table gets back a producer-side NOTIFY (the trigger migration 0010 removed), so that the
# run shows what the commit watcher's wake-up costs against a wake-up sent at the producer's commit.
# The bench also holds the watcher's lock (WATCH_LOCK), so that no relay watches.
OURS = ("ours", "notified", "baseline")  # outbox-relay relays ("baseline": the --baseline code's)
PRODUCER_NOTIFY = """
CREATE FUNCTION public.bench_notify_events() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_events_v2', (SELECT string_agg(DISTINCT n.bucket::text, ',') FROM new_events n));
    RETURN NULL;
END $$;
CREATE TRIGGER bench_notify AFTER INSERT ON outbox.events REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION public.bench_notify_events();
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat (R, S, T for stopped, ...); '' if the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def pct(p: float, xs: Sequence[float]) -> float | None:
    """The p-th percentile of sorted values (nearest rank), None if there are none."""
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else None


def summary(values: Sequence[float]) -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "values": []}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": list(vals)}


# -- shared helpers --------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, servers: Servers) -> None:
        self.args = args
        assert servers.postgres is not None and servers.tansu is not None
        self.pg = servers.postgres
        self.kafka = servers.tansu
        self.base = servers.base
        self.results: dict[str, Any] = {}

    def fresh_outbox_db(self, code: Path | None = None) -> tuple[str, str]:
        """``code``: a baseline's directory: its own migrations make the schema."""
        name = self.pg.create_database("outbox")
        dsn = self.pg.dsn(name)
        if code is not None:
            idle.migrate_with(code, dsn, SINK)
            return name, dsn
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            relay_store.register_sink(conn, SINK, "kafka")  # what the relay does at start; idempotent
        return name, dsn

    @property
    def baseline(self) -> Path | None:
        """--baseline: another version's code, run next to this tree's in the drain and latency cases."""
        return Path(self.args.baseline).resolve() if self.args.baseline else None

    def payload(self, i: int) -> dict[str, Any]:
        return {"order_id": i, "amount_cents": 1000 + i % 9000, "currency": "EUR",
                "customer": f"customer-{i % 5000}", "note": "outbox-relay bench event"}

    # -- relay processes -----------------------------------------------------------------------

    @staticmethod
    def relay_env(dsn: str, projections: bool = False, code: Path | None = None) -> dict[str, str]:
        """``code``: a directory with another version's outbox_relay package (a baseline), imported first."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env["OUTBOX_DSN"] = dsn
        if projections or code:  # bench_projection.py lives here
            env["PYTHONPATH"] = os.pathsep.join([*([str(code)] if code else []), str(HERE),
                                                 *filter(None, [os.environ.get("PYTHONPATH")])])
        return env

    def start_relays(self, n: int, dsn: str, topic: str, tag: str, extra: Sequence[str] = (),
                     projections: bool = False,
                     acks_to: Sequence[Path] = (), batch_size: int | None = -1, code: Path | None = None,
                     ) -> list[tuple[str, subprocess.Popen[bytes]]]:
        """``acks_to``: one file per relay, where it writes each event's broker-ack time when it stops
        (bench/ack_relay.py: the same command with an Observer.acknowledged hook). ``batch_size``: the relays'
        --batch-size (-1: the bench's --batch-size; None: none given, the relay's own default)."""
        size = self.args.batch_size if batch_size == -1 else batch_size
        env = self.relay_env(dsn, projections, code)
        relays = []
        for i in range(n):
            wid = f"bench-{tag}-{i}"
            logf = (self.base / f"{wid}.log").open("wb")
            entry = [str(HERE / "ack_relay.py"), str(acks_to[i])] if acks_to else ["-m", "outbox_relay.cli"]
            cmd = [sys.executable, *entry, "--log-level", "warning", "run",
                   "--default-topic", topic, "--kafka-bootstrap-servers", self.kafka.bootstrap,
                   *(["--batch-size", str(size)] if size is not None else []), "--worker-id", wid,
                   *self.args.relay_args, *extra]
            relays.append((wid, subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL)))
        return relays

    @staticmethod
    def stop_relays(relays: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
        for _, p in relays:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in relays:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    @staticmethod
    def peak_rss_mb(pid: int) -> float | None:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return None

    @staticmethod
    def wait_ring(conn: psycopg.Connection[Any], ids: list[str], relays: list[Any], timeout: float = 60.0,
                  sink: str = SINK) -> float:
        """Wait until the sink's stored assignment is made for exactly these relays and every bucket is
        leased by the owner it gives (a settled group)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            for wid, p in relays:
                if p.poll() is not None:
                    raise RuntimeError(f"relay {wid} exited with {p.returncode} while starting")
            stored = conn.execute("SELECT members, owners FROM outbox.assignments WHERE sink = %s", (sink,)).fetchone()
            rows = conn.execute("SELECT bucket, owner FROM outbox.cursors WHERE sink = %s", (sink,)).fetchall()
            if (stored is not None and list(stored[0]) == sorted(ids) and len(rows) == len(stored[1])
                    and all(stored[1][b] == o for b, o in rows)):
                return time.monotonic() - start
            time.sleep(0.05)
        raise RuntimeError(f"relays {ids} did not settle on the stored assignment within {timeout:.0f}s")

    @staticmethod
    def targets(conn: psycopg.Connection[Any]) -> tuple[list[int], list[int], list[int]]:
        """Per bucket, the last stored position: delivered once the bucket's cursor has delivered it
        (the events of one bucket are delivered in (xid, seq) order once their transactions ended)."""
        rows = conn.execute(
            "SELECT DISTINCT ON (bucket) bucket, xid::text::bigint, seq FROM outbox.events "
            "ORDER BY bucket, xid DESC, seq DESC").fetchall()
        return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]

    @staticmethod
    def wait_delivered(conn: psycopg.Connection[Any], targets: tuple[list[int], list[int], list[int]],
                       relays: list[Any], timeout: float, interval: float = 0.01, sink: str = SINK) -> float:
        buckets, xids, seqs = targets
        sql = ("SELECT count(*) FROM outbox.cursors c "
               "JOIN unnest(%s::int[], %s::bigint[], %s::bigint[]) AS t(bucket, xid, seq) ON t.bucket = c.bucket "
               "WHERE c.sink = %s AND outbox.delivered_v1(t.xid::text::xid8, t.seq, c.snapshot, c.target, "
               "c.after_xid, c.after_seq)")
        deadline = time.monotonic() + timeout
        while True:
            row = conn.execute(sql, (buckets, xids, seqs, sink)).fetchone()
            if row and row[0] == len(buckets):
                return time.time()
            if time.monotonic() > deadline:
                done = row[0] if row else 0
                raise RuntimeError(f"not delivered within {timeout:.0f}s ({done}/{len(buckets)} buckets)")
            for wid, p in relays:
                if p.poll() is not None:
                    raise RuntimeError(f"relay {wid} exited with {p.returncode}")
            time.sleep(interval)

    def count_topic(self, topic: str, expected: int, timeout: float = 60.0, ids_out: set[str] | None = None
                    ) -> dict[str, int]:
        """Consume the whole topic with assign() (Tansu's end offsets are not reliable)."""
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.kafka.bootstrap, "group.id": "outbox-bench-verify",
                             "enable.auto.commit": False, "fetch.wait.max.ms": 50})
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        messages = 0
        ids: set[str] = set()
        deadline = time.monotonic() + timeout
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            batch = consumer.consume(num_messages=5000, timeout=0.2)
            if batch:
                quiet_since = time.monotonic()
            for m in batch:
                if m.error():
                    continue
                messages += 1
                ce_id = next((v for k, v in (m.headers() or []) if k == "ce_id"), None)
                if ce_id is not None:
                    ids.add(ce_id.decode())
            if messages >= expected and time.monotonic() - quiet_since > 1.0:
                break
            if messages < expected and time.monotonic() - quiet_since > 10.0:
                break
        consumer.close()
        if ids_out is not None:
            ids_out.update(ids)
        return {"messages": messages, "distinct_ids": len(ids)}

    def warm_up(self, dsn: str, topic: str, relays: list[Any], sink: str = SINK, type_: str = "bench.warmup",
                payload: dict[str, Any] | None = None) -> int:
        """Deliver one event per bucket through running relays, so that each relay's producer
        knows the topic (librdkafka's first produce to an unseen topic waits about 0.5 s for
        metadata): a one-off cost of a fresh topic, not of delivery. A projection's warm-up must be
        of a type it handles: its cursor does not move past a bucket's skipped types alone."""
        outbox = Outbox(default_topic=topic)
        with psycopg.connect(dsn) as conn:
            keys = [r[0] for r in conn.execute(
                "SELECT DISTINCT ON (outbox.bucket_v1(k)) k "
                "FROM (SELECT 'warmup:' || g AS k FROM generate_series(1, 20000) AS g) s "
                "ORDER BY outbox.bucket_v1(k), k")]
            outbox.publish_many(conn, [{"type": type_, "key": k, "payload": payload or {}} for k in keys])
            conn.commit()
            targets = self.targets(conn)
        with psycopg.connect(dsn, autocommit=True) as poll:
            self.wait_delivered(poll, targets, relays, timeout=60, sink=sink)
        return len(keys)

    def publish_backlog(self, dsn: str, n: int, topic: str) -> float:
        """Publish n events in transactions of --tx-size (publish_many); returns the seconds it took."""
        outbox = Outbox(default_topic=topic)
        keys = self.args.keys
        tx = self.args.tx_size
        start = time.monotonic()
        with psycopg.connect(dsn) as conn:
            for lo in range(0, n, tx):
                outbox.publish_many(conn, [
                    {"type": "bench.order_paid", "key": f"order:{i % keys}", "payload": self.payload(i)}
                    for i in range(lo, min(n, lo + tx))])
                conn.commit()
        return time.monotonic() - start

    # Relays stopped longer than this could find each other's heartbeats stale (--worker-ttl-seconds,
    # default 10 s, checked every --heartbeat-seconds, default 2 s) and hand buckets over mid-drain.
    MAX_PAUSE_SECONDS = 5.0

    def release_backlog(self, dsn: str, n: int, topic: str, relays: list[tuple[str, subprocess.Popen[bytes]]],
                        out: dict[str, Any], on_release: Callable[[], None] | None = None,
                        ) -> tuple[tuple[list[int], list[int], list[int]], float]:
        """Publish the backlog while the running relays are stopped (SIGSTOP), then let them go
        (SIGCONT): the clock starts when they resume. Returns the delivery targets and that time.

        Relays read every committed event whatever else is open on the server, so a backlog can no
        longer be held back by an open transaction; a stopped process reads nothing. The pause is
        only the publishing time, well under the lease and the worker TTL, so no lease expires and
        no relay drops out of the assignment's live members; notifications sent meanwhile wait in the listener's
        socket and wake the relays as they resume, as do their overdue polls."""
        pids = [p.pid for _, p in relays]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        paused = time.monotonic()
        try:
            for pid in pids:  # the signal is asynchronous: publish only once every relay has stopped
                deadline = time.monotonic() + 5.0
                while process_state(pid) not in ("T", "t") and time.monotonic() < deadline:
                    time.sleep(0.001)
            out["publish_seconds"] = self.publish_backlog(dsn, n, topic)
            with psycopg.connect(dsn, autocommit=True) as conn:
                targets = self.targets(conn)
        finally:
            if on_release is not None:  # e.g. a CPU window that leaves the publishing out
                on_release()
            t0 = time.time()
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        out["pause_seconds"] = pause = time.monotonic() - paused
        if pause > self.MAX_PAUSE_SECONDS:
            log(f"WARNING: relays were paused {pause:.1f}s to publish the backlog (over {self.MAX_PAUSE_SECONDS:.0f}s: "
                "heartbeats may look stale and buckets change hands mid-drain); use fewer --events")
        return targets, t0

    # -- case 1 + 5: drain and peak RSS -----------------------------------------------------------

    def drain_once(self, relays_n: int, mode: str, verify: bool, run: int,
                   code: Path | None = None) -> dict[str, Any]:
        n = self.args.events
        name, dsn = self.fresh_outbox_db(code)
        topic = self.kafka.create_topic(f"drain{relays_n}", PARTITIONS)
        relays: list[tuple[str, subprocess.Popen[bytes]]] = []
        version = "baseline" if code else "this"
        out: dict[str, Any] = {"relays": relays_n, "mode": mode, "run": run, "version": version}
        warmups = 0
        # The drain ends at the broker's last acknowledgement (bench/ack_relay.py records each one); the
        # cursors only say when it is over: a Kafka relay writes them at most every --cursor-flush-seconds.
        acks = [self.base / f"drain-acks-{version}-{mode}{relays_n}r{run}-{i}.json" for i in range(relays_n)]
        try:
            with psycopg.connect(dsn, autocommit=True) as poll:
                if mode == "warm":
                    # Relays up and settled on the stored assignment, producers warmed up; then the backlog is
                    # published while they are stopped, and released by letting them go on.
                    relays = self.start_relays(relays_n, dsn, topic, f"{version}-{mode}{relays_n}r{run}",
                                               acks_to=acks, code=code)
                    out["settle_seconds"] = self.wait_ring(poll, [w for w, _ in relays], relays)
                    warmups = self.warm_up(dsn, topic, relays)
                    targets, t0 = self.release_backlog(dsn, n, topic, relays, out)
                else:
                    out["publish_seconds"] = self.publish_backlog(dsn, n, topic)
                    targets = self.targets(poll)
                    t0 = time.time()
                    relays = self.start_relays(relays_n, dsn, topic, f"{version}-{mode}{relays_n}r{run}",
                                               acks_to=acks, code=code)
                t_end = self.wait_delivered(poll, targets, relays, timeout=self.args.drain_timeout)
                row = poll.execute("SELECT extract(epoch FROM min(advanced_at))::float8 FROM outbox.cursors "
                                   "WHERE sink = %s AND advanced_at > to_timestamp(%s)", (SINK, t0)).fetchone()
                out["first_checkpoint_after_s"] = (row[0] - t0) if row and row[0] else None
            out["seconds"] = t_end - t0
            out["events_per_s"] = n / (t_end - t0)
            out["peak_rss_mb"] = {wid: self.peak_rss_mb(p.pid) for wid, p in relays}
            if verify:
                out["topic"] = self.count_topic(topic, n + warmups)
                out["topic"]["expected"] = n + warmups
        finally:
            self.stop_relays(relays)
            self.pg.drop_database(name)
        last_ack = max((t for f in acks if f.exists() for t in json.loads(f.read_text())["acks"].values()),
                       default=None)
        out["cursor_seconds"] = out["seconds"]
        if last_ack is not None and last_ack > t0:
            out["seconds"] = last_ack - t0
            out["events_per_s"] = n / out["seconds"]
        return out

    def case_throughput(self, kinds: Sequence[str]) -> None:
        """The drain cases of ``kinds`` (drain: ours; tuned: the tuned SQL relay; reference: the seeds'
        loop), interleaved: run 1 of each process count of each kind, then run 2, ..., so that load
        from outside the bench skews them alike and the ratios compare runs made side by side."""
        counts = sorted({*(self.args.relays if "drain" in kinds else ()),
                         *(self.args.tuned_workers if "tuned" in kinds else ()),
                         *(self.args.ref_workers if "reference" in kinds else ())})
        for kind in kinds:
            self.results[kind] = []
        for run in range(self.args.runs):
            for n in counts:
                if "drain" in kinds and n in self.args.relays:
                    for mode, code in ((m, c) for m in self.args.drain_modes
                                       for c in ((None, self.baseline) if self.baseline else (None,))):
                        r = self.drain_once(n, mode, run == 0 and mode == "warm" and code is None, run, code)
                        rss = max(v or 0 for v in r["peak_rss_mb"].values())
                        log(f"drain {mode} {n} relays{' (baseline)' if code else ''} run {run + 1}: "
                            f"{r['events_per_s']:,.0f} ev/s "
                            f"({r['seconds']:.2f}s, cursor write after {r['first_checkpoint_after_s'] or 0:.2f}s, "
                            f"rss {rss:.0f} MB)"
                            + (f", topic {r['topic']}" if "topic" in r else ""))
                        self.results["drain"].append(r)
                if "tuned" in kinds and n in self.args.tuned_workers:
                    r = self.tuned_once(n, run, verify=run == 0)
                    log(f"tuned SQL relay {n} workers run {run + 1}: {r['events_per_s']:,.0f} ev/s "
                        f"({r['seconds']:.2f}s, {r['batches']} batches)"
                        + (f", topic {r['topic']}" if "topic" in r else ""))
                    self.results["tuned"].append(r)
                if "reference" in kinds and n in self.args.ref_workers:
                    r = self.reference_once(n, run)
                    log(f"reference {n} workers run {run + 1}: {r['events_per_s']:,.0f} ev/s ({r['seconds']:.2f}s)")
                    self.results["reference"].append(r)

    # -- the tuned set-based SQL relay (procs.py tuned-worker) ----------------------------------------

    def tuned_once(self, workers: int, run: int, verify: bool) -> dict[str, Any]:
        """The same N, keys and payloads in the tuned relay's table, then ``workers`` processes drain
        it; the clock starts when all of them are connected and have the topic's metadata."""
        import uuid

        from procs import TUNED_ENQUEUE, TUNED_SCHEMA

        n = self.args.events
        name = self.pg.create_database("tuned")
        dsn = self.pg.dsn(name)
        topic = self.kafka.create_topic(f"tuned{workers}", PARTITIONS)
        procs: list[subprocess.Popen[str]] = []
        try:
            with psycopg.connect(dsn) as conn:
                conn.execute(TUNED_SCHEMA)
                conn.commit()
                for lo in range(0, n, self.args.tx_size):
                    rng = range(lo, min(n, lo + self.args.tx_size))
                    conn.execute(TUNED_ENQUEUE, {"ids": [str(uuid.uuid4()) for _ in rng],
                                                 "keys": [f"order:{i % self.args.keys}" for i in rng],
                                                 "topics": [topic] * len(rng),
                                                 "payloads": [json.dumps(self.payload(i)) for i in rng]})
                    conn.commit()
            for _ in range(workers):
                procs.append(subprocess.Popen(
                    [sys.executable, str(PROCS), "tuned-worker", "--dsn", dsn, "--bootstrap", self.kafka.bootstrap,
                     "--topic", topic, "--batch-size", str(self.args.tuned_batch)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            t0 = self._ready_go(procs, "tuned worker")
            reports = []
            for p in procs:
                stdout, _ = p.communicate(timeout=self.args.drain_timeout)
                if p.returncode != 0:
                    raise RuntimeError(f"tuned worker exited with {p.returncode}")
                reports.append(json.loads(stdout.strip().splitlines()[-1]))
            t_end = max(r["last_done"] for r in reports)
            with psycopg.connect(dsn, autocommit=True) as conn:
                row = conn.execute("SELECT count(*) FILTER (WHERE status = 1) FROM tuned_outbox").fetchone()
            if not row or row[0] != n:
                raise RuntimeError(f"tuned relay delivered {row[0] if row else 0} of {n} rows")
            out: dict[str, Any] = {
                "workers": workers, "run": run, "seconds": t_end - t0, "events_per_s": n / (t_end - t0),
                "processed": [r["processed"] for r in reports], "batches": sum(r["batches"] for r in reports)}
            if verify:
                out["topic"] = self.count_topic(topic, n)
                out["topic"]["expected"] = n
            return out
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            self.pg.drop_database(name)

    # -- case 2: the seed reference loop -----------------------------------------------------------

    def reference_once(self, workers: int, run: int) -> dict[str, Any]:
        from procs import REF_ENQUEUE, REF_SCHEMA, ref_bucket

        n = self.args.events
        name = self.pg.create_database("ref")
        dsn = self.pg.dsn(name)
        topic = self.kafka.create_topic(f"ref{workers}", PARTITIONS)
        procs: list[subprocess.Popen[str]] = []
        try:
            with psycopg.connect(dsn) as conn:
                conn.execute(REF_SCHEMA)
                conn.commit()
                for lo in range(0, n, self.args.tx_size):
                    rng = range(lo, min(n, lo + self.args.tx_size))
                    keys = [f"order:{i % self.args.keys}" for i in rng]
                    conn.execute(REF_ENQUEUE, {"keys": keys, "buckets": [ref_bucket(k) for k in keys],
                                               "payloads": [json.dumps(self.payload(i)) for i in rng]})
                    conn.commit()
            for i in range(workers):
                cmd = [sys.executable, str(PROCS), "ref-worker", "--dsn", dsn, "--bootstrap", self.kafka.bootstrap,
                       "--topic", topic, "--id", f"ref-{run}-{i}"]
                if self.args.ref_per_row_flush:
                    cmd.append("--per-row-flush")
                procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            for p in procs:
                assert p.stdout is not None
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError("reference worker failed to start")
            t0 = time.time()
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            reports = []
            for p in procs:
                stdout, _ = p.communicate(timeout=self.args.drain_timeout)
                if p.returncode != 0:
                    raise RuntimeError(f"reference worker exited with {p.returncode}")
                reports.append(json.loads(stdout.strip().splitlines()[-1]))
            t_end = max(r["last_done"] for r in reports)
            with psycopg.connect(dsn, autocommit=True) as conn:
                row = conn.execute("SELECT count(*) FILTER (WHERE status = 'completed') FROM inbox").fetchone()
            assert row is not None
            if row[0] != n:
                raise RuntimeError(f"reference loop completed {row[0]} of {n} rows")
            return {"workers": workers, "run": run, "seconds": t_end - t0, "events_per_s": n / (t_end - t0),
                    "processed": [r["processed"] for r in reports], "stale_completes": sum(r["stale"] for r in reports)}
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            self.pg.drop_database(name)

    # -- case 3: steady-state latency ----------------------------------------------------------------

    def latency_once(self, kind: str, rate: float, relays_n: int, run: int, seconds: float,
                     longtx: bool = False) -> dict[str, Any]:
        """Publish at ``rate`` for ``seconds`` with ``relays_n`` relays of ``kind`` running ("ours":
        `outbox-relay run`; "tuned": the tuned SQL relay of procs.py) and time every event.
        ``longtx``: a writing transaction in another database of the same server stays open from
        before the first event until the consumer has everything (or gave up waiting)."""
        tag = f"{kind}{int(rate)}x{relays_n}r{run}{'L' if longtx else ''}"
        code = self.baseline if kind == "baseline" else None
        if kind in OURS:
            name, dsn = self.fresh_outbox_db(code)
            if kind == "notified":
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute(PRODUCER_NOTIFY)
        else:
            from procs import TUNED_SCHEMA

            name = self.pg.create_database("tuned")
            dsn = self.pg.dsn(name)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(TUNED_SCHEMA)
        topic = self.kafka.create_topic(f"lat-{tag}", PARTITIONS)
        relays: list[tuple[str, subprocess.Popen[bytes]]] = []
        workers: list[subprocess.Popen[str]] = []
        consumer = producer = None
        held: psycopg.Connection[Any] | None = None
        held_db = None
        # The control: the bench holds the commit watcher's lock, so that no relay watches and every
        # relay's LISTEN connection is free to read the producer's notification at once.
        unwatched = None
        if kind == "notified":
            unwatched = psycopg.connect(dsn, autocommit=True)
            unwatched.execute("SELECT pg_advisory_lock(%s)", (WATCH_LOCK,))
        commits_path = self.base / f"lat-commits-{tag}.json"
        received_path = self.base / f"lat-received-{tag}.json"
        acks_paths = [self.base / f"lat-acks-{tag}-{i}.json" for i in range(relays_n)]
        out: dict[str, Any] = {"kind": kind, "rate": rate, "relays": relays_n, "run": run, "longtx": longtx}
        try:
            consumer = subprocess.Popen(
                [sys.executable, str(PROCS), "latency-consumer", "--bootstrap", self.kafka.bootstrap,
                 "--topic", topic, "--partitions", str(PARTITIONS), "--out", str(received_path), "--timeout", "10"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            warmups = 0
            if kind in OURS:
                relays = self.start_relays(relays_n, dsn, topic, f"lat-{tag}", acks_to=acks_paths, code=code)
                with psycopg.connect(dsn, autocommit=True) as poll:
                    self.wait_ring(poll, [w for w, _ in relays], relays)
                warmups = self.warm_up(dsn, topic, relays)
            else:
                for i in range(relays_n):
                    workers.append(subprocess.Popen(
                        [sys.executable, str(PROCS), "tuned-worker", "--dsn", dsn, "--bootstrap", self.kafka.bootstrap,
                         "--topic", topic, "--batch-size", str(self.args.tuned_batch), "--serve",
                         "--out", str(acks_paths[i])],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
                self._ready_go(workers, "tuned worker")
            assert consumer.stdout is not None and consumer.stdin is not None
            if consumer.stdout.readline().strip() != "ready":
                raise RuntimeError("latency consumer failed to start")
            if longtx:
                held_db, held = self.open_long_transaction()
                out["held_from"] = time.time()
            out["table_before"] = self.hot_table(dsn, kind)
            notes = NotifyLog(dsn) if kind in OURS and self.args.latency_stages else None
            spy = None
            if kind in OURS and self.args.latency_spy:
                spy_raw = self.base / f"lat-spy-{tag}.txt"
                spy = subprocess.Popen(
                    [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                     str(relays[-1][1].pid), *([] if self.args.latency_spy_on_cpu else ["--idle"]), "--threads",
                     "--format", "raw", "--rate", "200",
                     "--duration", str(max(1, int(seconds) - 2)), "--output", str(spy_raw), "--nonblocking"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            producer = subprocess.Popen(
                [sys.executable, str(PROCS), "latency-producer", "--dsn", dsn, "--topic", topic,
                 "--rate", str(rate), "--duration", str(seconds),
                 "--tick-ms", str(self.args.latency_tick_ms), "--per-tx", str(self.args.latency_per_tx),
                 "--keys", str(self.args.keys),
                 "--target", "outbox" if kind in OURS else "tuned", "--out", str(commits_path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert producer.stdout is not None and producer.stdin is not None
            if producer.stdout.readline().strip() != "ready":
                raise RuntimeError("latency producer failed to start")
            producer.stdin.write("go\n")
            producer.stdin.flush()
            # Where the CPU goes while events flow (stopped before the producer exits: its time counts).
            postmaster = cpu.postmaster_pid(self.pg.dir)
            serving = [p.pid for _, p in relays] + [w.pid for w in workers]
            clients = [producer.pid, consumer.pid]
            with psycopg.connect(self.pg.admin_dsn, autocommit=True) as conn:  # backend pid -> who it serves
                apps = dict(conn.execute("SELECT pid, application_name FROM pg_stat_activity").fetchall())

            def backends(of: str) -> list[int]:
                pids = [postmaster, *cpu.children(postmaster)] if postmaster else []
                mine = {"relays": ("outbox-relay", "bench-tuned"), "producer": ("bench-producer",)}
                if of == "rest":
                    return [p for p in pids if not str(apps.get(p, "")).startswith(("outbox-relay", "bench-"))]
                return [p for p in pids if str(apps.get(p, "")).startswith(mine[of])]

            window = cpu.CpuWindow({
                "relays": lambda: serving,
                "postgres for relays": lambda: backends("relays"),
                "postgres for producer": lambda: backends("producer"),
                "postgres other": lambda: backends("rest"),
                "broker": lambda: [self.kafka.proc.pid],
                "bench clients": lambda: clients,
            })
            window.start()
            time.sleep(max(0.5, seconds - 1.0))
            out["cpu"] = window.stop()
            pstdout, _ = producer.communicate(timeout=seconds + 60)
            if spy is not None:
                spy.wait(60)
                out["spy"] = str(spy_raw)
            sent = json.loads(pstdout.strip().splitlines()[-1])
            consumer.stdin.write(f"expect {sent['sent'] + warmups}\n")
            consumer.stdin.flush()
            consumer.communicate(timeout=60)
            out["table_after"] = self.hot_table(dsn, kind)
            if held is not None:
                out["held_until"] = time.time()
                out["held_seconds"] = self.close_long_transaction(held, out["held_from"])
                held = None
            if notes is not None:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    buckets = dict(conn.execute("SELECT id::text, bucket FROM outbox.events").fetchall())
                out.update(notify_stages(json.loads(commits_path.read_text())["commits"],
                                         json.loads(received_path.read_text()).get("produced", {}), buckets,
                                         notes.stop()))
            if kind in OURS:
                out["peak_rss_mb"] = {wid: self.peak_rss_mb(p.pid) for wid, p in relays}
                out["missing_diagnosis"] = self.diagnose_missing(dsn, commits_path, received_path, topic)
                self.stop_relays(relays)  # each writes its ack times as it exits
                acked = {}
                batches: list[list[Any]] = []
                for path in acks_paths:
                    if not path.exists():  # killed after the drain timed out: its acks are not counted
                        log(f"WARNING: no ack times from {path.name}")
                        continue
                    recorded = json.loads(path.read_text())
                    for i, t in recorded["acks"].items():
                        acked[i] = min(t, acked.get(i, t))  # a bucket handed over may be sent twice
                    batches.extend(recorded["batches"])
                    out["reads"] = out.get("reads", 0) + recorded.get("reads", 0)
                    out["empty_reads"] = out.get("empty_reads", 0) + recorded.get("empty_reads", 0)
                out.update(batch_stages(batches, json.loads(commits_path.read_text())["commits"]))
            else:
                out["peak_rss_mb"] = {f"tuned-{i}": self.peak_rss_mb(p.pid) for i, p in enumerate(workers)}
                with psycopg.connect(dsn, autocommit=True) as poll:  # every event marked delivered
                    deadline = time.monotonic() + 60
                    while (poll.execute("SELECT count(*) FROM tuned_outbox WHERE status = 0").fetchone() or [0])[0]:
                        if time.monotonic() > deadline:
                            raise RuntimeError("tuned relay: events still pending 60s after the producer stopped")
                        time.sleep(0.05)
                reports = self._stop_serving(workers)
                out["batches"] = sum(r["batches"] for r in reports)
                acked = {}
                for path in acks_paths:
                    for i, t in json.loads(path.read_text())["acks"].items():
                        acked[i] = min(t, acked.get(i, t))
                out["missing_diagnosis"] = self.diagnose_missing(None, commits_path, received_path, topic)
        finally:
            for p in (producer, consumer, *workers):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
            if held is not None:
                held.close()
            if unwatched is not None:
                unwatched.close()
            if held_db is not None:
                self.pg.drop_database(held_db)
            self.stop_relays(relays)
            self.pg.drop_database(name)
        commits = json.loads(commits_path.read_text())
        received = json.loads(received_path.read_text())
        got = received["received"]
        lat = sorted((got[i] - t) * 1000 for i, t in commits["commits"].items() if i in got)
        # Commit -> the broker's ack: the first delivery report with an offset for the event, as the
        # relay's own poll served it (ours: Observer.acknowledged; the tuned relay: its on_delivery).
        ack = sorted((acked[i] - t) * 1000 for i, t in commits["commits"].items() if i in acked)
        # Split at the relay's produce() call (the message's CreateTime, same clock):
        # commit -> produce is the relay's pickup; produce -> receive is librdkafka + Tansu + consumer.
        made = received.get("produced", {})
        pickup = sorted((made[i] - t) * 1000 for i, t in commits["commits"].items() if i in made)
        transit = sorted((got[i] - made[i]) * 1000 for i in commits["commits"] if i in made and i in got)
        # The pickup's complement: produce() -> acknowledged.
        settle = sorted((acked[i] - made[i]) * 1000 for i in commits["commits"] if i in made and i in acked)
        out.update({
            "sent": sent["sent"], "seconds": sent["seconds"], "achieved_rate": sent["sent"] / sent["seconds"],
            "transactions": sent["transactions"], "received": len(lat), "missing": len(commits["commits"]) - len(lat),
            "duplicates": received["duplicates"],
            "ack_p50_ms": pct(50, ack), "ack_p90_ms": pct(90, ack), "ack_p99_ms": pct(99, ack),
            "ack_max_ms": ack[-1] if ack else None, "ack_measured": len(ack),
            "p50_ms": pct(50, lat), "p90_ms": pct(90, lat), "p99_ms": pct(99, lat), "max_ms": lat[-1] if lat else None,
            "pickup_p50_ms": pct(50, pickup), "pickup_p99_ms": pct(99, pickup),
            "transit_p50_ms": pct(50, transit), "transit_p99_ms": pct(99, transit),
            "settle_p50_ms": pct(50, settle), "settle_p99_ms": pct(99, settle),
        })
        if longtx:
            # Delivered while the transaction was open, and the tail at the end of the window (a
            # transaction that holds back vacuum makes some costs grow with time).
            until = out["held_until"]
            out["acked_while_held"] = sum(1 for i in commits["commits"] if i in acked and acked[i] < until)
            last = sorted(commits["commits"].values())
            cut = last[int(0.75 * len(last))] if last else 0.0
            tail = sorted((acked[i] - t) * 1000 for i, t in commits["commits"].items() if i in acked and t >= cut)
            out["ack_p99_last_quarter_ms"] = pct(99, tail)
        return out

    @staticmethod
    def hot_table(dsn: str, kind: str) -> dict[str, Any]:
        """Size and dead row versions of the table each batch updates (ours: outbox.cursors; the tuned
        relay: its table and its claim index): what vacuum can not clean while a transaction is open."""
        table, index = ("outbox.cursors", "outbox.cursors_pkey") if kind in OURS else (
            "public.tuned_outbox", "public.tuned_outbox_claim")
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT pg_relation_size(%s::regclass), pg_relation_size(%s::regclass), n_dead_tup, n_tup_upd, "
                "n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = %s::regclass", (table, index, table)).fetchone()
        assert row is not None
        return {"table": table, "table_bytes": row[0], "index": index, "index_bytes": row[1], "dead_tuples": row[2],
                "updates": row[3], "hot_updates": row[4]}

    def open_long_transaction(self) -> tuple[str, psycopg.Connection[Any]]:
        """A transaction that has written (so it has a transaction id) and stays open, in a database of
        its own on the same server: transaction ids and snapshots are server-wide."""
        db = self.pg.create_database("longtx")
        conn = psycopg.connect(self.pg.dsn(db), application_name="outbox-bench long transaction")
        conn.execute("CREATE TABLE held (x int)")
        conn.commit()
        conn.execute("INSERT INTO held VALUES (1)")  # a transaction id; the transaction stays open
        return db, conn

    def close_long_transaction(self, conn: psycopg.Connection[Any], since: float) -> float:
        """Check it is still open with its transaction id, roll it back; how long it was held."""
        with psycopg.connect(self.pg.admin_dsn, autocommit=True) as admin:
            row = admin.execute("SELECT backend_xid IS NOT NULL, state FROM pg_stat_activity WHERE pid = %s",
                                (conn.info.backend_pid,)).fetchone()
        if not row or not row[0] or row[1] != "idle in transaction":
            raise RuntimeError(f"the long transaction did not stay open with a transaction id: {row}")
        held = time.time() - since
        conn.rollback()
        conn.close()
        return held

    @staticmethod
    def _ready_go(procs: Sequence[subprocess.Popen[str]], what: str) -> float:
        """Wait for every process's ``ready``, then tell them all to go; returns the time just before."""
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{what} failed to start")
        t0 = time.time()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        return t0

    @staticmethod
    def _stop_serving(workers: Sequence[subprocess.Popen[str]]) -> list[dict[str, Any]]:
        for p in workers:
            assert p.stdin is not None
            p.stdin.write("stop\n")
            p.stdin.flush()
        reports = []
        for p in workers:
            stdout, _ = p.communicate(timeout=60)
            if p.returncode != 0:
                raise RuntimeError(f"tuned worker exited with {p.returncode}")
            reports.append(json.loads(stdout.strip().splitlines()[-1]))
        return reports

    def diagnose_missing(self, dsn: str | None, commits_path: Path, received_path: Path, topic: str
                         ) -> dict[str, Any] | None:
        """If the consumer did not see some committed events, say where they are (never expected).
        ``dsn``: an outbox database (None for the tuned relay's: only the topic is searched)."""
        commits = json.loads(commits_path.read_text())["commits"]
        got = json.loads(received_path.read_text())["received"]
        missing = [i for i in commits if i not in got]
        if not missing:
            return None
        rows: list[Any] = []
        strangers: list[str] = []
        if dsn is not None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                known = {str(r[0]) for r in conn.execute("SELECT id FROM outbox.events")}
                rows = conn.execute(
                    "SELECT e.id::text, e.bucket, e.xid::text, e.seq, e.partition_key, "
                    "outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq) AS delivered, "
                    "c.snapshot::text, c.target::text, c.after_xid::text, c.after_seq, c.owner "
                    "FROM outbox.events e JOIN outbox.cursors c "
                    "ON c.sink = %s AND c.bucket = e.bucket WHERE e.id = ANY(%s::uuid[])", (SINK, missing)).fetchall()
            strangers = [i for i in got if i not in known]
        # Is it on the topic at all? A second consumer reads everything from the beginning.
        on_topic: set[str] = set()
        recount = self.count_topic(topic, len(got) + len(missing), timeout=30, ids_out=on_topic)
        out = {"missing": [list(r) for r in rows], "received_unknown_to_db": strangers[:20],
               "second_consumer": recount, "missing_found_by_second_consumer": sum(i in on_topic for i in missing),
               "consumer_exit": json.loads(received_path.read_text()).get("exit"),
               "received_total": len(got), "committed_total": len(commits)}
        log(f"MISSING at the consumer: {json.dumps(out, default=str)[:2000]}")
        return out

    def latency_line(self, r: dict[str, Any]) -> str:
        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        return (f"{r['kind']} {r['relays']} relay{'s' if r['relays'] > 1 else ''} at {r['rate']:.0f} ev/s run "
                f"{r['run'] + 1}{' (long transaction open)' if r['longtx'] else ''}: commit->ack p50 "
                f"{f(r['ack_p50_ms'])} ms, p99 {f(r['ack_p99_ms'])} ms, max {f(r['ack_max_ms'])} ms; "
                f"commit->produce p50/p99 {f(r['pickup_p50_ms'])}/{f(r['pickup_p99_ms'])} ms; commit->consumer "
                f"p50/p99 {f(r['p50_ms'])}/{f(r['p99_ms'])} ms ({r['received']}/{r['sent']} received, "
                f"{r['ack_measured']} acked, {r['achieved_rate']:.0f} ev/s achieved)"
                + (f"; acked while held {r['acked_while_held']}, held {r['held_seconds']:.0f}s" if r["longtx"] else "")
                + (f"; commit->notified p50/p99 {f(r['notified_p50_ms'])}/{f(r['notified_p99_ms'])} ms, "
                   f"notified->produce "
                   f"p50/p99 {f(r['woken_to_produce_p50_ms'])}/{f(r['woken_to_produce_p99_ms'])} ms, "
                   f"produce->ack p50/p99 {f(r['settle_p50_ms'])}/{f(r['settle_p99_ms'])} ms"
                   if "notified_p50_ms" in r else "")
                + (f"; {r['batches']} batches of {r['batch_events']:.1f} events, handed to the sink->last ack "
                   f"p50/p99 {f(r['batch_acks_p50_ms'])}/{f(r['batch_acks_p99_ms'])} ms, last ack->landed "
                   f"{f(r['batch_fence_p50_ms'])}/{f(r['batch_fence_p99_ms'])} ms"
                   if r.get("batch_events") is not None else "")
                + "; cpu (cores) " + ", ".join(f"{k} {v:.2f}" for k, v in r.get("cpu", {}).items()))

    def case_latency(self) -> None:
        runs = []
        for run in range(self.args.runs):
            for rate in self.args.latency_rates:
                for relays_n in self.args.latency_relays:
                    for kind in self.args.latency_kinds:
                        r = self.latency_once(kind, rate, relays_n, run, self.args.latency_seconds)
                        log(self.latency_line(r))
                        runs.append(r)
        self.results["latency"] = runs

    def case_longtx(self) -> None:
        """Latency while a writing transaction stays open, next to the same run without it."""
        runs = []
        for run in range(self.args.longtx_runs):
            for kind in self.args.longtx_kinds:
                for held in (True, False):
                    r = self.latency_once(kind, self.args.longtx_rate, self.args.longtx_relays, run,
                                          self.args.longtx_seconds, longtx=held)
                    log(self.latency_line(r))
                    runs.append(r)
        self.results["longtx"] = runs

    # -- case 4: enqueue rate ----------------------------------------------------------------------

    def enqueue_once(self, per_tx: int, run: int) -> dict[str, Any]:
        name, dsn = self.fresh_outbox_db()
        procs: list[subprocess.Popen[str]] = []
        try:
            for i in range(self.args.producers):
                procs.append(subprocess.Popen(
                    [sys.executable, str(PROCS), "enqueue", "--dsn", dsn, "--topic", "bench-enqueue",
                     "--per-tx", str(per_tx), "--duration", str(self.args.enqueue_seconds), "--id", str(i),
                     "--keys", str(self.args.keys)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            for p in procs:
                assert p.stdout is not None
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError("enqueue producer failed to start")
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            reports = []
            for p in procs:
                stdout, _ = p.communicate(timeout=self.args.enqueue_seconds + 60)
                reports.append(json.loads(stdout.strip().splitlines()[-1]))
            with psycopg.connect(dsn, autocommit=True) as conn:
                row = conn.execute("SELECT count(*) FROM outbox.events").fetchone()
            stored = row[0] if row else 0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            self.pg.drop_database(name)
        events = sum(r["events"] for r in reports)
        seconds = max(r["seconds"] for r in reports)
        if stored != events:
            raise RuntimeError(f"enqueue: producers reported {events} events, the table holds {stored}")
        txs = sum(r["transactions"] for r in reports)
        return {"per_tx": per_tx, "run": run, "producers": len(reports), "events": events,
                "seconds": seconds, "events_per_s": events / seconds, "transactions_per_s": txs / seconds}

    def case_enqueue(self) -> None:
        runs = []
        for run in range(self.args.runs):
            for per_tx in (1, 100):
                r = self.enqueue_once(per_tx, run)
                log(f"enqueue {per_tx}/tx run {run + 1}: "
                    f"{r['events_per_s']:,.0f} ev/s ({r['transactions_per_s']:,.0f} tx/s)")
                runs.append(r)
        self.results["enqueue"] = runs

    # -- case 6: claim-query cost as history grows -----------------------------------------------------

    # Payloads built in SQL for generate_series loads (g is the event number; %% as they run with params).
    HISTORY_PAYLOAD = ("jsonb_build_object('order_id', g, 'amount_cents', 1000 + g %% 9000, 'currency', 'EUR', "
                       "'note', 'delivered history')")
    ORDER_PAYLOAD = ("jsonb_build_object('order_id', g, 'amount_cents', 1000 + g %% 9000, 'currency', 'EUR', "
                     "'customer', 'customer-' || (g %% 5000), 'note', 'outbox-relay bench event')")  # = payload(g)

    def load_events(self, conn: psycopg.Connection[Any], first: int, count: int, *, type_: str, topic: str,
                    payload_sql: str, age: str, chunk: int = 500_000) -> None:
        """Events first..first+count-1 straight into outbox.events with generate_series, 500k rows
        per transaction (one statement per chunk: seconds per million rows, not minutes)."""
        done = 0
        while done < count:
            step = min(chunk, count - done)
            with conn.transaction():
                # Backdated history: created_at is the database's to set (trigger events_check);
                # the bench loads it with ordinary triggers off, as a restore would (superuser).
                conn.execute("SET LOCAL session_replication_role = replica")
                conn.execute(
                    "INSERT INTO outbox.events (partition_key, topic, type, payload, created_at) "
                    f"SELECT 'order:' || (g %% %s), %s, %s, {payload_sql}, now() - %s::interval "
                    "FROM generate_series(%s::bigint, %s::bigint) AS g",
                    (self.args.keys, topic, type_, age, first + done, first + done + step - 1))
            done += step

    @staticmethod
    def deliver_all(conn: psycopg.Connection[Any]) -> None:
        """Everything stored so far becomes delivered history: every cursor of the sink has seen a
        snapshot in which all of it is visible (as if the relay had read up to now)."""
        conn.execute(
            "UPDATE outbox.cursors c SET snapshot = pg_current_snapshot(), target = NULL, after_xid = NULL, "
            "after_seq = NULL WHERE c.sink = %s", (SINK,))

    def lease_to(self, conn: psycopg.Connection[Any], owner: str) -> tuple[list[int], int]:
        """Lease --claim-buckets buckets to one owner (as fetch_events joins on them); returns them
        and the relay's own per-bucket limit for a full batch spread over them."""
        buckets = list(range(self.args.claim_buckets))
        conn.execute(
            "UPDATE outbox.cursors SET owner = %s, fence = 1, lease_expires_at = now() + interval '1 day' "
            "WHERE sink = %s AND bucket = ANY(%s::int[])", (owner, SINK, buckets))
        return buckets, max(8, self.args.batch_size // len(buckets))

    def publish_pending(self, conn: psycopg.Connection[Any], pending: int, topic: str) -> None:
        """Pending events, committed (so in the relays' next delta), in transactions of 500."""
        outbox = Outbox(default_topic=topic)
        for lo in range(0, pending, 500):
            with conn.transaction():
                outbox.publish_many(conn, [
                    {"type": "bench.pending", "key": f"order:{i % self.args.keys}",
                     "payload": self.payload(i)} for i in range(lo, min(pending, lo + 500))])

    def claim_cost(self, conn: psycopg.Connection[Any], owner: str, buckets: list[int], limit: int
                   ) -> dict[str, Any]:
        """VACUUM ANALYZE, then EXPLAIN (ANALYZE, BUFFERS) of the relay's fetch over the leased buckets."""
        conn.execute("VACUUM ANALYZE outbox.events")
        # Each bucket's read cursor, as the relay passes it (store.fetch_events).
        stored = {r[0]: positions.Cursor.from_row(*r[1:]) for r in conn.execute(
            "SELECT bucket, snapshot::text, target::text, after_xid::text, after_seq FROM outbox.cursors "
            "WHERE sink = %s AND bucket = ANY(%s::int[])", (SINK, buckets))}
        # The Kafka sink: every event, headers.
        params = relay_store.fetch_params(SINK, owner, {b: (limit, stored[b]) for b in buckets})
        fetch = relay_store.fetch_sql(conn, {b: (limit, stored[b]) for b in buckets})
        row = conn.execute(
            "SELECT count(*) FROM outbox.events e JOIN outbox.cursors c ON c.sink = %s AND c.bucket = e.bucket "
            "AND NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq) "
            "WHERE c.owner = %s", (SINK, owner)).fetchone()
        explains = []
        for _ in range(max(3, self.args.runs)):
            plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + fetch,
                                params).fetchone()
            assert plan is not None
            explains.append(plan[0][0])
        text_plan = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + fetch, params))
        size = self.table_sizes(conn)
        return {
            "pending_in_leased_buckets": row[0] if row else 0,
            "buckets": len(buckets),
            "per_bucket_limit": limit,
            "rows_returned": int(explains[-1]["Plan"].get("Actual Rows") or 0),
            "execution_ms": summary([e["Execution Time"] for e in explains]),
            "planning_ms": summary([e["Planning Time"] for e in explains]),
            "shared_hit": explains[-1]["Plan"].get("Shared Hit Blocks"),
            "shared_read": explains[-1]["Plan"].get("Shared Read Blocks"),
            "first_run_shared_read": explains[0]["Plan"].get("Shared Read Blocks"),
            "uses_events_position": "events_position" in text_plan,
            **size,
            "plan": text_plan,
        }

    @staticmethod
    def table_sizes(conn: psycopg.Connection[Any]) -> dict[str, int]:
        size = conn.execute(
            "SELECT pg_total_relation_size('outbox.events'), pg_relation_size('outbox.events'), "
            "pg_relation_size('outbox.events_position'), pg_indexes_size('outbox.events')").fetchone()
        assert size is not None
        return {"total_bytes": size[0], "table_bytes": size[1], "position_index_bytes": size[2],
                "indexes_bytes": size[3]}

    def case_claim(self) -> None:
        name, dsn = self.fresh_outbox_db()
        owner = "bench-claim"
        sizes = []
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("SET plan_cache_mode = force_custom_plan")  # a read's first plans
                buckets, limit = self.lease_to(conn, owner)
                stored = 0
                for target in self.args.claim_sizes:
                    t_load = time.monotonic()
                    pending = self.args.claim_pending
                    history = target - pending - stored  # earlier pending events became history too
                    if history > 0:
                        self.load_events(conn, stored + 1, history, type_="bench.history", topic="bench-history",
                                         payload_sql=self.HISTORY_PAYLOAD, age="1 day")
                        stored += history
                    self.deliver_all(conn)
                    self.publish_pending(conn, pending, "bench-claim")
                    stored += pending
                    entry = {"stored_events": stored, "pending_total": pending,
                             **self.claim_cost(conn, owner, buckets, limit)}
                    entry["load_seconds"] = load_s = time.monotonic() - t_load  # includes VACUUM ANALYZE
                    log(f"claim cost at {stored:,} events: {entry['execution_ms']['median']:.2f} ms, "
                        f"shared hit {entry['shared_hit']}, read {entry['shared_read']}, "
                        f"{entry['rows_returned']} rows, size {entry['total_bytes'] / 2**20:.0f} MiB "
                        f"(load {load_s:.0f}s)")
                    sizes.append(entry)
        finally:
            self.pg.drop_database(name)
        self.results["claim"] = sizes

    # -- profile ---------------------------------------------------------------------------------

    def case_profile(self) -> None:
        """One warm drain with one relay under py-spy; summarise where its time goes."""

        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        n = self.args.events
        name, dsn = self.fresh_outbox_db()
        topic = self.kafka.create_topic("profile", PARTITIONS)
        relays: list[tuple[str, subprocess.Popen[bytes]]] = []
        raw = RESULTS / f"profile-{self.stamp}.txt"
        try:
            with psycopg.connect(dsn, autocommit=True) as poll:
                relays = self.start_relays(1, dsn, topic, "profile")
                self.wait_ring(poll, [w for w, _ in relays], relays)
                self.warm_up(dsn, topic, relays)
                spy_proc = subprocess.Popen([spy, "record", "--pid", str(relays[0][1].pid), "--rate", "200",
                                             "--idle", "--nonblocking", "--format", "raw", "--output", str(raw)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
                targets, t0 = self.release_backlog(dsn, n, topic, relays, {})
                t_end = self.wait_delivered(poll, targets, relays, timeout=self.args.drain_timeout)
                spy_proc.send_signal(signal.SIGINT)
                spy_proc.wait(30)
        finally:
            self.stop_relays(relays)
            self.pg.drop_database(name)
        self.results["profile"] = {"events_per_s": n / (t_end - t0), "raw": str(raw),
                                   "top": profile_summary(raw) if raw.exists() else None}
        log(f"profile: {n / (t_end - t0):,.0f} ev/s under py-spy; raw stacks in {raw}")

    def case_profile_projection(self) -> None:
        """One warm projection drain (the first of --projection-handlers, 1 relay) under py-spy."""
        handler = self.args.projection_handlers[0]
        raw = RESULTS / f"profile-projection-{self.stamp}.txt"
        r = projection_cases.projection_once(self, 1, False, 0, handler, spy=raw)
        self.results["profile-projection"] = {"handler": handler, "events_per_s": r["events_per_s"], "raw": str(raw),
                                              "top": profile_summary(raw) if raw.exists() else None}
        log(f"profile-projection ({handler}): {r['events_per_s']:,.0f} ev/s under py-spy; raw stacks in {raw}")

    # -- entry --------------------------------------------------------------------------------------

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")


class NotifyLog:
    """A LISTEN client on the relays' wake-up channel that records when each notification arrived
    (the watching relay's NOTIFY, as every other relay's listener receives it)."""

    def __init__(self, dsn: str) -> None:
        self.notes: list[tuple[float, str]] = []
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._conn.execute("LISTEN outbox_events_v2")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for n in self._conn.notifies(timeout=0.2):
                self.notes.append((time.time(), n.payload))

    def stop(self) -> list[tuple[float, str]]:
        self._stop.set()
        self._thread.join(5)
        self._conn.close()
        return self.notes


def batch_stages(batches: list[list[Any]], commits: dict[str, float]) -> dict[str, Any]:
    """Our relays' batches from the first commit on (bench/ack_relay.py): how many, their size, and
    each one split into handed to the sink (its read done) -> last ack (produce and the broker's acks)
    -> landed (the fenced checkpoint: for Kafka mostly a fence check, the cursor write being deferred)."""
    if not commits:
        return {}
    first = min(commits.values())  # the warm-up's batches come before; none but the window's after it
    during = [b for b in batches if b[0] >= first and b[3]]
    acks = sorted((b[1] - b[0]) * 1000 for b in during if b[1] is not None)
    fence = sorted((b[2] - b[1]) * 1000 for b in during if b[1] is not None and b[2] is not None)
    return {"batches": len(during), "batch_events": sum(b[3] for b in during) / len(during) if during else None,
            "batch_acks_p50_ms": pct(50, acks), "batch_acks_p99_ms": pct(99, acks),
            "batch_fence_p50_ms": pct(50, fence), "batch_fence_p99_ms": pct(99, fence)}


def notify_stages(commits: dict[str, float], produced: dict[str, float], buckets: dict[str, int],
                  notes: list[tuple[float, str]]) -> dict[str, Any]:
    """Split commit -> produce() at the first wake-up notification after the commit that names the
    event's bucket: commit -> notified (the watcher's look and its NOTIFY) and notified -> produce()
    (the owner's wake-up, its cycle in progress, its read)."""
    import bisect

    times = [t for t, _ in notes]
    named = [set(p.split(",")) for _, p in notes]
    seen, pickup = [], []
    for eid, committed in commits.items():
        b = buckets.get(eid)
        if b is None:
            continue
        i = bisect.bisect_left(times, committed)
        while i < len(times) and not (str(b) in named[i] or "*" in named[i]):
            i += 1
        if i == len(times):
            continue
        seen.append((times[i] - committed) * 1000)
        if eid in produced:
            pickup.append((produced[eid] - times[i]) * 1000)
    seen.sort()
    pickup.sort()
    return {"notified_p50_ms": pct(50, seen), "notified_p99_ms": pct(99, seen),
            "woken_to_produce_p50_ms": pct(50, pickup), "woken_to_produce_p99_ms": pct(99, pickup),
            "notifications": len(notes), "notified_measured": len(seen)}


def _frame_key(frame: str) -> str:
    """'func (path/file.py:123)' -> 'func (file.py)'."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.split(':')[0].rsplit('/', 1)[-1]})" if where else name


def profile_summary(raw: Path, top: int = 30) -> dict[str, Any]:
    """Wall-time share per function in the sink thread while it has work, from py-spy's collapsed
    stacks (--idle: waiting on Postgres or on broker acks counts too; waiting for work does not).
    Inclusive: the function or anything it called. Self: the innermost frame."""
    inclusive: dict[str, int] = {}
    self_t: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if "SinkRunner.run (" not in stack:
            continue
        count = int(count_s)
        frames = [_frame_key(f) for f in stack.split(";")]
        idle = frames[-3:-1] == ["SinkRunner.run (relay.py)", "Event.wait (threading.py)"]
        if idle or "wait_idle (engine.py)" in frames:  # a sink with idle(): a projection
            continue  # idle: waiting for work (before the backlog is released, after it is done)
        total += count
        for key in set(frames):
            inclusive[key] = inclusive.get(key, 0) + count
        self_t[frames[-1]] = self_t.get(frames[-1], 0) + count

    def share(d: dict[str, int]) -> list[tuple[str, float]]:
        ranked = sorted(d.items(), key=lambda kv: -kv[1])[:top]
        return [(k, round(100 * v / total, 1)) for k, v in ranked] if total else []

    return {"sink_thread_samples": total, "inclusive_pct": share(inclusive), "self_pct": share(self_t)}


# -- report -----------------------------------------------------------------------------------------


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit in ("ev/s", "tx/s"):
        return f"{v:,.0f}"
    if unit == "x":
        return f"{v:.2f}"
    if unit in ("MB", "MiB"):
        return f"{v:,.0f}"
    if unit == "n" and float(v).is_integer():
        return f"{v:.0f}"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def report(meta: dict[str, Any], results: dict[str, Any]) -> str:
    lines: list[str] = []
    m = meta["machine"]
    lines.append(f"## outbox-relay bench, {meta['started']}")
    lines.append("")
    lines.append(f"Machine: {m['cores']} cores, {m.get('ram_gib', '?')} GiB RAM, {m.get('cpu', '?')}, "
                 f"Linux {m['kernel']}, Python {m['python']}. PostgreSQL {meta['postgres']['version']} "
                 f"(embedded; fsync={meta['postgres']['settings']['fsync']}, synchronous_commit="
                 f"{meta['postgres']['settings']['synchronous_commit']}, shared_buffers="
                 f"{meta['postgres']['settings']['shared_buffers']}), Tansu broker (in-memory), "
                 f"topics of {PARTITIONS} partitions.")
    busy = meta.get("background_busy", {})
    if busy:
        lines.append("CPU busy (all cores) in the second before each case, i.e. load from outside the bench: "
                     + ", ".join(f"{c} {100 * b:.0f}%" for c, b in busy.items())
                     + ". Anything well above 0% means the figures are skewed by other work.")
    a = meta["args"]
    lines.append(f"N = {a['events']:,} events over {a['keys']:,} keys, published in transactions of {a['tx_size']}; "
                 f"relay --batch-size {a['batch_size']} (projection relays: "
                 f"{a.get('projection_batch_size') or 'none given, their default'}); {a['runs']} runs per case: "
                 "median (min-max).")
    if a.get("issue8"):
        lines.append("")
        lines.append(issue8.table(meta, results))
        lines.append("")
        lines.append("### Every figure of this run")
    lines.append("")
    lines.append("| case | metric | median | min | max | runs |")
    lines.append("|---|---|---:|---:|---:|---:|")

    def row(case: str, metric: str, unit: str, values: Sequence[float | None]) -> dict[str, Any]:
        s = summary([v for v in values if v is not None])
        lines.append(f"| {case} | {metric} | {fmt(s['median'], unit)} | {fmt(s['min'], unit)} | "
                     f"{fmt(s['max'], unit)} | {len(s['values'])} |")
        return s

    ours: dict[int, list[float]] = {}
    ours_cold: dict[int, list[float]] = {}
    if "drain" in results:
        for mode in a["drain_modes"]:
            for r_n in a["relays"]:
                label = {"warm": "backlog released to running relays", "cold": "from relay process start"}[mode]
                for version in ("this", "baseline") if a.get("baseline") else ("this",):
                    rs = [r for r in results["drain"] if r["relays"] == r_n and r["mode"] == mode
                          and r.get("version", "this") == version]
                    which = " (baseline)" if version == "baseline" else ""
                    row(f"drain {a['events']:,}, {r_n} relay{'s' if r_n > 1 else ''}{which} ({label})", "events/s",
                        "ev/s", [r["events_per_s"] for r in rs])
                    if version == "this":
                        (ours if mode == "warm" else ours_cold)[r_n] = [r["events_per_s"] for r in rs]
    if "projection" in results:
        handlers = {"per-event": "one upsert per event", "batched": "batched handler: one upsert per batch"}
        for handler in a.get("projection_handlers", ["per-event"]):
            for r_n in a["relays"]:
                rs = [r for r in results["projection"] if r["relays"] == r_n
                      and r.get("handler", "per-event") == handler]
                row(f"projection {a['events']:,}, {r_n} relay{'s' if r_n > 1 else ''} (backlog released to running "
                    f"relays, {handlers[handler]})", "events/s", "ev/s", [r["events_per_s"] for r in rs])
    tuned: dict[int, list[float]] = {}
    if "tuned" in results:
        for w in a["tuned_workers"]:
            tuned[w] = [r["events_per_s"] for r in results["tuned"] if r["workers"] == w]
            row(f"tuned SQL relay, {w} worker{'s' if w > 1 else ''} (one UPDATE claims {a['tuned_batch']} with SKIP "
                "LOCKED, produce, one flush, commit)", "events/s", "ev/s", tuned[w])
        for w in a["tuned_workers"]:
            if ours.get(w) and tuned.get(w):
                pairs = [o / r for o, r in zip(ours[w], tuned[w], strict=False)]
                med = statistics.median(ours[w]) / statistics.median(tuned[w])
                lines.append(f"| ratio ours (released backlog)/tuned SQL relay, {w} vs {w} | x (paired runs) | "
                             f"{med:.2f} | {min(pairs):.2f} | {max(pairs):.2f} | {len(pairs)} |")
    ref: dict[int, list[float]] = {}
    if "reference" in results:
        flush = "per-row produce+flush" if a["ref_per_row_flush"] else "produce 25, one flush"
        for w in a["ref_workers"]:
            rs = [r for r in results["reference"] if r["workers"] == w]
            ref[w] = [r["events_per_s"] for r in rs]
            row(f"seed reference loop, {w} worker{'s' if w > 1 else ''} (claim 25 SKIP LOCKED, {flush}, "
                f"complete row by row)", "events/s", "ev/s", ref[w])
        for label, mine in (("released backlog", ours), ("from relay process start", ours_cold)):
            for w in a["ref_workers"]:
                if mine.get(w) and ref.get(w):
                    pairs = [o / r for o, r in zip(mine[w], ref[w], strict=False)]
                    med = statistics.median(mine[w]) / statistics.median(ref[w])
                    lines.append(f"| ratio ours ({label})/reference, {w} relay{'s' if w > 1 else ''} vs {w} "
                                 f"worker{'s' if w > 1 else ''} | x (paired runs) | {med:.1f} | {min(pairs):.1f} | "
                                 f"{max(pairs):.1f} | {len(pairs)} |")
    def latency_rows(case: str, rs: list[dict[str, Any]]) -> None:
        ack = "broker ack"  # both kinds: the delivery report's time in the relay process
        row(case, "achieved publish rate ev/s", "ev/s", [r["achieved_rate"] for r in rs])
        for k, label in (("ack_p50_ms", f"commit -> {ack} p50 ms"),
                         ("ack_p99_ms", f"commit -> {ack} p99 ms"),
                         ("ack_max_ms", f"commit -> {ack} max ms"),
                         ("pickup_p50_ms", "commit -> relay produce() p50 ms"),
                         ("pickup_p99_ms", "commit -> relay produce() p99 ms"),
                         ("settle_p50_ms", f"relay produce() -> {ack} p50 ms"),
                         ("settle_p99_ms", f"relay produce() -> {ack} p99 ms"),
                         ("batch_acks_p50_ms", "batch handed to the sink -> its last ack p50 ms"),
                         ("batch_acks_p99_ms", "batch handed to the sink -> its last ack p99 ms"),
                         ("batch_fence_p50_ms", "batch's last ack -> landed (fenced checkpoint) p50 ms"),
                         ("batch_fence_p99_ms", "batch's last ack -> landed (fenced checkpoint) p99 ms"),
                         ("p50_ms", "commit -> consumer receive p50 ms"),
                         ("p99_ms", "commit -> consumer receive p99 ms"),
                         ("max_ms", "commit -> consumer receive max ms")):
            if any(k in r for r in rs):  # the batch split: ours only
                row(case, label, "ms", [r.get(k) for r in rs])
        if all("batches" in r for r in rs):
            row(case, "batches (claims with events) while publishing", "", [r["batches"] for r in rs])
        if all("reads" in r for r in rs):  # the whole run, warm-up and drain included
            row(case, "relay reads (the whole run)", "", [r["reads"] for r in rs])
            row(case, "relay reads that found nothing", "", [r["empty_reads"] for r in rs])
        for group in ("relays", "postgres for relays", "postgres for producer", "postgres other", "broker",
                      "bench clients", "machine"):
            if all(group in r.get("cpu", {}) for r in rs):
                what = "all cores busy" if group == "machine" else group
                row(case, f"CPU while publishing: {what}, cores", "cores", [r["cpu"][group] for r in rs])
        if all({"relays", "postgres for relays"} <= set(r.get("cpu", {})) for r in rs):
            # What delivering costs the machine: the relays' CPU and their database sessions', per event sent.
            row(case, "CPU per event: relays + their postgres sessions, ms", "ms",
                [1000 * (r["cpu"]["relays"] + r["cpu"]["postgres for relays"]) / r["achieved_rate"] for r in rs])
        lost = sum(r["missing"] for r in rs)
        if lost:
            found = sum((r.get("missing_diagnosis") or {}).get("missing_found_by_second_consumer", 0) for r in rs)
            lines.append(f"| {case} | events the live consumer never received (all runs) | {lost} | | | |")
            lines.append(f"| {case} | ... of which a second consumer found on the topic | {found} | | | |")

    kind_label = {"ours": "outbox-relay", "notified": "outbox-relay + producer NOTIFY (control)",
                  "tuned": "tuned SQL relay", "baseline": "outbox-relay (baseline)"}
    if "latency" in results:
        for rate in a["latency_rates"]:
            for r_n in a["latency_relays"]:
                for kind in a["latency_kinds"]:
                    rs = [r for r in results["latency"] if r["rate"] == rate and r["relays"] == r_n
                          and r["kind"] == kind]
                    if rs:
                        latency_rows(f"latency {kind_label[kind]} at {rate:,.0f} ev/s, {r_n} "
                                     f"{'relay' if kind in OURS else 'worker'}{'s' if r_n > 1 else ''}, "
                                     f"{a['latency_seconds']:.0f}s", rs)
    if "longtx" in results:
        for kind in a["longtx_kinds"]:
            for held in (True, False):
                rs = [r for r in results["longtx"] if r["kind"] == kind and r["longtx"] == held]
                if not rs:
                    continue
                case = (f"long transaction: {kind_label[kind]} at {a['longtx_rate']:,.0f} ev/s, {a['longtx_relays']} "
                        f"{'relays' if kind == 'ours' else 'workers'}, {a['longtx_seconds']:.0f}s, "
                        + ("a writing transaction open throughout" if held else "none open (same run)"))
                latency_rows(case, rs)
                if held:
                    row(case, "share of events acked while the transaction was open", "%",
                        [100 * r["acked_while_held"] / r["sent"] for r in rs])
                    row(case, "commit -> ack p99 ms, last quarter of the window", "ms",
                        [r["ack_p99_last_quarter_ms"] for r in rs])
                    row(case, "transaction held open s", "s", [r["held_seconds"] for r in rs])
    if "idle" in results:
        lines.append("")
        lines.extend(idle.report_rows(argparse.Namespace(**a), results["idle"]))
    if "fleet" in results:
        for f_n in a["fleet_sizes"]:
            rs = [r for r in results["fleet"] if r["relays"] == f_n]
            case = f"fleet of {f_n} `outbox-relay run` processes, idle {a['fleet_idle_seconds']:.0f}s"
            row(case, "statements/s per idle relay (pg_stat_statements)", "/s",
                [r["idle"]["pss_statements_per_relay_s"] for r in rs])
            row(case, "statements/s per idle relay (statement log, mean; the same statements)", "/s",
                [r["idle"]["log_statements_per_relay_s"]["mean"] for r in rs])
            row(case, "... the median relay (one relay runs each housekeeping pass)", "/s",
                [r["idle"]["log_statements_per_relay_s"]["median"] for r in rs])
            row(case, "... plus empty statements/s per relay (psycopg_pool connection checks, mean)", "/s",
                [r["idle"]["log_pool_checks_per_relay_s"]["mean"] for r in rs])
            row(case, "housekeeping passes/s (all relays)", "/s", [r["idle"]["housekeeping_passes_per_s"] for r in rs])
            row(case, "housekeeping claim attempts/s (all relays)", "/s",
                [r["idle"]["housekeeping_claims_per_s"] for r in rs])
            row(case, "connections per relay (median of relays' medians)", "n",
                [r["idle"]["connections_per_relay"]["median"] for r in rs])
            row(case, "connections per relay (max)", "n", [r["idle"]["connections_per_relay"]["max"] for r in rs])
            row(case, "bucket balance max/mean", "x", [r["idle"]["balance"]["max_over_mean"] for r in rs])
            row(case, "relays owning no bucket", "n", [r["idle"]["balance"]["owning_none"] for r in rs])
            w_ms = f"{1000 * a['fleet_wake_window']:.0f} ms"
            row(case, "relays woken per single-event commit", "n",
                [r["commits"]["woken_relays_per_commit"] for r in rs])
            row(case, "fetch_events per single-event commit (the owner's, and one per other relay woken)", "n",
                [r["commits"]["fetch_events_per_commit"] for r in rs])
            row(case, f"commits after which the bucket's owner ran fetch_events within {w_ms}", "%",
                [100 * r["commits"]["owner_fetched_share"] for r in rs])
            row(case, "... and showed as woken (sooner after its previous fetch than a poll comes)", "%",
                [100 * r["commits"]["owner_seen_woken_share"] for r in rs])
            row(case, "other relays that showed as woken, per commit", "n",
                [r["commits"]["others_seen_woken_per_commit"] for r in rs])
            row(case, "hand-over: one relay joins, spawn -> every bucket with its new owner", "s",
                [r["handover"]["join_from_spawn_s"] for r in rs])
            row(case, "hand-over: ... from its first heartbeat", "s",
                [r["handover"]["join_from_registration_s"] for r in rs])
            row(case, "hand-over: buckets moved by the join", "n", [r["handover"]["join_moved_buckets"] for r in rs])
            row(case, "hand-over: one relay leaves (SIGTERM -> every bucket with its new owner)", "s",
                [r["handover"]["leave_s"] for r in rs])
    if "enqueue" in results:
        for per_tx in (1, 100):
            rs = [r for r in results["enqueue"] if r["per_tx"] == per_tx]
            if rs:
                row(f"enqueue, {a['producers']} producer processes, {per_tx} event{'s' if per_tx > 1 else ''}/"
                    "transaction",
                    "events/s", "ev/s", [r["events_per_s"] for r in rs])
    if "rebuild" in results:
        rs = [r for r in results["rebuild"] if r.get("handler") == "sql"]
        if rs:
            row(f"the same read model from {a['rebuild_events']:,} stored events by one plain INSERT ... SELECT "
                "(the database alone, no relay)", "events/s", "ev/s", [r["events_per_s"] for r in rs])
        for procs, handler in ((p, h) for p in a["rebuild_procs"] for h in a.get("rebuild_handlers", ["per-event"])
                               if h != "sql"):
            rs = [r for r in results["rebuild"] if r["processes"] == procs and r.get("handler", "per-event") == handler]
            case = (f"rebuild of the projection from {a['rebuild_events']:,} stored events, {handler} handler, "
                    f"{procs} `outbox-relay rebuild` process{'es' if procs > 1 else ''} (spawn to exit)")
            row(case, "events/s", "ev/s", [r["events_per_s"] for r in rs])
            row(case, "seconds", "s", [r["seconds"] for r in rs])
            row(case, "CPU of the rebuild processes per event", "us", [r["cpu_us_per_event"] for r in rs])
            if procs > 1:
                row(case, "seconds to the first exit (the one that switched over)", "s",
                    [r["first_exit_seconds"] for r in rs])
    for label, key in (("drain", "drain"), ("projection", "projection")):
        if key in results:
            for r_n in a["relays"]:
                rs = [r for r in results[key] if r["relays"] == r_n]
                row(f"relay peak RSS (VmHWM) after {label}, {r_n} relay{'s' if r_n > 1 else ''}",
                    "MB, max over relays", "MB",
                    [max(v for v in r["peak_rss_mb"].values() if v is not None) for r in rs])
    claims = [(f"{c['stored_events']:,}", c) for c in results.get("claim", [])]
    if claims:
        lines.append("")
        c0 = claims[0][1]
        lines.append(f"Claim query (`relay.fetch_events`, EXPLAIN ANALYZE BUFFERS, {c0['buckets']} leased buckets, "
                     f"limit {c0['per_bucket_limit']} per bucket, {c0['pending_total']:,} pending events; "
                     f"all older events are delivered history behind the cursors):")
        lines.append("")
        lines.append("| stored events | pending in leased buckets | rows returned | execution ms median (min-max) | "
                     "planning ms | shared hit | shared read | uses events_position | table+indexes |")
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---|---:|")
        for stored, c in claims:
            e = c["execution_ms"]
            lines.append(f"| {stored} | {c['pending_in_leased_buckets']:,} | {c['rows_returned']} | "
                         f"{e['median']:.2f} ({e['min']:.2f}-{e['max']:.2f}) | {c['planning_ms']['median']:.2f} | "
                         f"{c['shared_hit']} | {c['shared_read']} | {'yes' if c['uses_events_position'] else 'NO'} | "
                         f"{c['total_bytes'] / 2**20:,.0f} MiB |")
    if "drain" in results:
        checks = [r for r in results["drain"] if "topic" in r]
        if checks:
            lines.append("")
            lines.append("Topic check (consumed with assign()): " + "; ".join(
                f"{r['relays']} relay{'s' if r['relays'] > 1 else ''}: {r['topic']['messages']:,} messages, "
                f"{r['topic']['distinct_ids']:,} distinct ce_id, expected {r['topic']['expected']:,}" for r in checks))
    if "projection" in results:
        checks = [r for r in results["projection"] if "check" in r]
        if checks:
            lines.append("")
            lines.append("Projection check (bench_totals against the stored events, per customer): " + "; ".join(
                f"{r['relays']} relay{'s' if r['relays'] > 1 else ''}: {r['check']['mismatched_customers']} "
                f"mismatched customers, {r['check']['orders'] - r['check']['warmup_orders']:,} orders, "
                f"{r['check']['cents']:,} cents (published {r['check']['published_cents']:,})" for r in checks))
    if "rebuild" in results:
        rs = results["rebuild"]
        lines.append("")
        lines.append("Rebuild check (bench_totals after the switch against the events the rebuild passed, per "
                     "customer): " + "; ".join(
                         f"{r.get('handler', 'per-event')}, {r['processes']} "
                         f"process{'es' if r['processes'] > 1 else ''} run {r['run'] + 1}: "
                         f"{r['check']['mismatched_customers']} mismatched, {r['check']['cents']:,} cents of "
                         f"{r['check']['all_events']['expected_cents']:,} stored, {r['left_to_live_relay']} events "
                         f"left to the live relay, most buckets held per process "
                         f"{sorted(r['bucket_owners'].values(), reverse=True)}"
                         for r in rs if r.get("handler") != "sql"))
    for key, what in (("profile", "draining"), ("profile-projection", "projecting")):
        if key not in results or not results[key].get("top"):
            continue
        p = results[key]
        lines.append("")
        lines.append(f"Profile of one relay {what} {a['events']:,} events"
                     + (f" ({p['handler']} handler)" if "handler" in p else "")
                     + f" (py-spy --idle, sink thread, {p['top']['sink_thread_samples']} busy samples, "
                     f"{p['events_per_s']:,.0f} ev/s under the profiler), share of the sink thread's busy wall "
                     "time, inclusive:")
        lines.append("")
        for k, v in p["top"]["inclusive_pct"][:25]:
            lines.append(f"- {v:5.1f}%  {k}")
    if "write" in results:
        lines.append("")
        lines.append(write_path.report(meta, results["write"]))
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="about 2 minutes: fewer events, runs and sizes")
    p.add_argument("--cases", default="drain,tuned,projection,reference,latency,enqueue,claim,rebuild",
                   help="comma list of drain, tuned, projection, reference, latency, longtx, fleet, enqueue, claim, "
                        "profile-projection, "
                        "rebuild, profile, write (history: bench/history.py); issue8 = drain,tuned,reference,"
                        "latency,longtx,fleet and the issue's table")
    p.add_argument("--events", type=int, default=None, help="N for drain and reference (default 20000)")
    p.add_argument("--runs", type=int, default=None, help="runs per case (default 3)")
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--tx-size", type=int, default=500, help="events per producer transaction for the backlog")
    p.add_argument("--batch-size", type=int, default=1000, help="relay --batch-size")
    p.add_argument("--relays", default=None,
                   help="relay process counts for the drain and projection cases (default 1,2,4; issue8: 1,4)")
    p.add_argument("--drain-modes", default=None,
                   help="warm: relays running and settled, then the backlog is released; cold: timed from spawn "
                        "(default warm,cold; --quick and issue8: warm)")
    p.add_argument("--drain-timeout", type=float, default=300.0)
    p.add_argument("--relay-args", default="", help="extra `outbox-relay run` options for every relay, one string")
    p.add_argument("--ref-workers", default="1,4")
    p.add_argument("--tuned-workers", default="1,4", help="process counts of the tuned SQL relay (drain)")
    p.add_argument("--tuned-batch", type=int, default=500, help="rows the tuned SQL relay claims at once")
    p.add_argument("--ref-per-row-flush", action="store_true",
                   help="reference handler waits for each row's ack (the seed's literal loop)")
    p.add_argument("--latency-rates", default=None, help="events/s, comma list (default 1000,5000)")
    p.add_argument("--latency-seconds", type=float, default=None, help="publish duration (default 15)")
    p.add_argument("--latency-relays", default="1,4", help="relay process counts, comma list")
    p.add_argument("--latency-kinds", default="ours,tuned",
                   help="ours (outbox-relay run), tuned (the tuned SQL relay) and/or notified (a control: ours with "
                        "a producer-side NOTIFY trigger added by the bench), comma list")
    p.add_argument("--longtx-seconds", type=float, default=None,
                   help="longtx: publish duration with the transaction held open (default 60, --quick 20)")
    p.add_argument("--longtx-rate", type=float, default=1000.0)
    p.add_argument("--longtx-relays", type=int, default=4)
    p.add_argument("--longtx-kinds", default="ours,tuned")
    p.add_argument("--longtx-runs", type=int, default=None, help="default: --runs (--quick: 1)")
    p.add_argument("--idle-relays", default="1,4", help="idle case: relay process counts, comma list")
    p.add_argument("--idle-seconds", type=float, default=60.0, help="idle case: the CPU window")
    p.add_argument("--idle-settle", type=float, default=10.0, help="idle case: quiet seconds before the window")
    p.add_argument("--idle-events", type=int, default=20, help="idle case: single-event commits after quiet gaps")
    p.add_argument("--idle-gap", type=float, default=10.0, help="idle case: quiet seconds before each (plus 0-1 s)")
    p.add_argument("--idle-runs", type=int, default=1)
    p.add_argument("--idle-max-intervals", default="",
                   help="idle case: also run this tree with each of these --watch-max-interval-ms, comma list")
    p.add_argument("--baseline", default=None,
                   help="drain and latency cases: also run the outbox_relay package in this directory (git archive "
                        "REV | tar -x -C DIR), interleaved with this tree's, each on a database its code migrated")
    p.add_argument("--idle-baseline", default=None,
                   help="idle case: also run the outbox_relay package in this directory (git archive main | tar -x)")
    p.add_argument("--fleet-sizes", default="32,64", help="relay processes in the fleet case, comma list")
    p.add_argument("--fleet-runs", type=int, default=1)
    p.add_argument("--fleet-idle-seconds", type=float, default=None, help="default 60, --quick 20")
    p.add_argument("--fleet-commits", type=int, default=None, help="single-event commits (default 120, --quick 60)")
    p.add_argument("--fleet-commit-gap", type=float, default=0.5, help="seconds between those commits")
    p.add_argument("--fleet-wake-window", type=float, default=0.25,
                   help="a relay that runs fetch_events this soon after a commit (and sooner after its previous "
                        "one than a poll comes) counts as woken by it")
    p.add_argument("--fleet-wake-all", action="store_true",
                   help="diagnostic: each single-event commit also notifies every relay (checks that the wake-up "
                        "count sees wake-ups)")
    p.add_argument("--fleet-settle-seconds", type=float, default=None,
                   help="wait after the assignment settled, before measuring (default 10, --quick 5)")
    p.add_argument("--fleet-start-timeout", type=float, default=300.0)
    p.add_argument("--latency-tick-ms", type=float, default=10.0,
                   help="the producer commits the events due every tick in one transaction")
    p.add_argument("--latency-per-tx", type=int, default=0,
                   help="latency case: events per producer transaction (default 0: a tick's; 1: a commit per event)")
    p.add_argument("--latency-stages", action="store_true",
                   help="latency case: also time the wake-up notifications (commit -> notified -> produce())")
    p.add_argument("--latency-spy", action="store_true",
                   help="latency case: py-spy record (--idle, raw) the last relay while events flow")
    p.add_argument("--latency-spy-on-cpu", action="store_true",
                   help="with --latency-spy: only samples on the CPU (no --idle), to see where the relay's CPU goes")
    p.add_argument("--producers", type=int, default=4, help="producer processes for the enqueue case")
    p.add_argument("--enqueue-seconds", type=float, default=None, help="default 5")
    p.add_argument("--claim-sizes", default=None, help="stored events, comma list (default 10000,1000000,5000000)")
    p.add_argument("--claim-buckets", type=int, default=64)
    p.add_argument("--claim-pending", type=int, default=4000,
                   help="pending events over all 256 buckets (about a quarter fall in the leased 64)")
    p.add_argument("--rebuild-events", type=int, default=None,
                   help="stored events the rebuild case replays (default 1000000)")
    p.add_argument("--rebuild-tx-events", type=int, default=500_000,
                   help="the rebuild case loads its events in transactions of this many (default 500000: a bulk "
                        "import; e.g. 100 for history written by ordinary transactions)")
    p.add_argument("--projection-batch-size", type=int, default=0,
                   help="relay --batch-size in the projection case (0: none given, the relay's default: 4,096 for a "
                        "batched projection, 1,000 for a per-event one)")
    p.add_argument("--projection-handlers", default="per-event",
                   help="projection case: per-event (bench_totals, one upsert per event) and/or batched "
                        "(bench_totals_batched, one set-based upsert per batch), interleaved")
    p.add_argument("--rebuild-procs", default="1,2", help="`outbox-relay rebuild` processes started together")
    p.add_argument("--rebuild-handlers", default="sql,per-event,batched",
                   help="rebuild with the per-event handler (bench_totals), the batched set-based one "
                        "(bench_totals_batched), and the same model by one plain INSERT ... SELECT (sql), "
                        "interleaved in one run; KIND[@base][#BATCH_SIZE]: @base runs it on the code at "
                        "--rebuild-baseline, #N with --batch-size N (#0: the rebuild's default) instead of the "
                        "bench's, e.g. batched,batched@base,batched#0")
    p.add_argument("--rebuild-baseline", default=None,
                   help="a source tree (with outbox_relay/, projections/, sql/) to rebuild the @base handlers with: "
                        "the code before a change, side by side with it")
    p.add_argument("--profile", action="store_true", help="also run one drain under py-spy (same as --cases +profile)")
    p.add_argument("--keep", action="store_true", help="keep the server directory under /tmp")
    write_path.add_arguments(p)
    args = p.parse_args(argv)
    quick = args.quick
    args.cases = [c for c in args.cases.split(",") if c]
    wants_issue8 = "issue8" in args.cases
    if wants_issue8:
        args.cases = [c for c in args.cases if c != "issue8"]
        args.cases += [c for c in ISSUE8_CASES if c not in args.cases]
        if args.latency_rates is None:  # the issue's table has rows at both rates, also with --quick
            args.latency_rates = "1000,5000"
    args.issue8 = wants_issue8
    args.events = args.events or (10_000 if quick else 20_000)
    args.runs = args.runs or (2 if quick else 3)
    args.latency_rates = [float(x) for x in (args.latency_rates or ("1000" if quick else "1000,5000")).split(",")]
    args.latency_seconds = args.latency_seconds or (8.0 if quick else 15.0)
    args.latency_relays = [int(x) for x in args.latency_relays.split(",")]
    args.latency_kinds = [x for x in args.latency_kinds.split(",") if x]
    if args.baseline and "baseline" not in args.latency_kinds:
        args.latency_kinds.insert(args.latency_kinds.index("ours") + 1 if "ours" in args.latency_kinds else 0,
                                  "baseline")
    args.longtx_seconds = args.longtx_seconds or (20.0 if quick else 60.0)
    args.longtx_kinds = [x for x in args.longtx_kinds.split(",") if x]
    args.longtx_runs = args.longtx_runs or (1 if quick else args.runs)
    args.fleet_sizes = [int(x) for x in args.fleet_sizes.split(",")]
    args.idle_relays = [int(x) for x in args.idle_relays.split(",")]
    args.idle_max_intervals = [x for x in args.idle_max_intervals.split(",") if x]
    args.fleet_idle_seconds = args.fleet_idle_seconds or (20.0 if quick else 60.0)
    args.fleet_commits = args.fleet_commits or (60 if quick else 120)
    args.fleet_settle_seconds = args.fleet_settle_seconds if args.fleet_settle_seconds is not None else (
        5.0 if quick else 10.0)
    args.tuned_workers = [int(x) for x in args.tuned_workers.split(",")]
    args.enqueue_seconds = args.enqueue_seconds or (3.0 if quick else 5.0)
    args.claim_sizes = [int(x) for x in (args.claim_sizes or ("10000,1000000" if quick
                                                             else "10000,1000000,5000000")).split(",")]
    args.rebuild_events = args.rebuild_events or (100_000 if quick else 1_000_000)
    args.rebuild_procs = [int(x) for x in args.rebuild_procs.split(",")]
    args.rebuild_handlers = [h.strip() for h in args.rebuild_handlers.split(",") if h.strip()]
    args.projection_handlers = [h.strip() for h in args.projection_handlers.split(",") if h.strip()]
    if not set(args.projection_handlers) <= set(projection_cases.REBUILD_HANDLERS):
        p.error(f"--projection-handlers: one of {', '.join(projection_cases.REBUILD_HANDLERS)}")
    try:
        specs = [projection_cases.handler_spec(h) for h in args.rebuild_handlers]
    except ValueError as exc:
        p.error(str(exc))
    if any(base for _, base, _ in specs) and not args.rebuild_baseline:
        p.error("--rebuild-handlers: a @base handler needs --rebuild-baseline")
    args.relays = [int(x) for x in (args.relays or ("1,4" if wants_issue8 else "1,2,4")).split(",")]
    args.relay_args = shlex.split(args.relay_args)
    args.ref_workers = [int(x) for x in args.ref_workers.split(",")]
    modes = args.drain_modes or ("warm" if quick or wants_issue8 else "warm,cold")
    args.drain_modes = [x for x in modes.split(",") if x]
    if args.profile and "profile" not in args.cases:
        args.cases.append("profile")
    write_path.finish_arguments(args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    t_start = time.monotonic()
    with Servers(keep=args.keep) as servers:
        assert servers.postgres is not None
        bench = Bench(args, servers)
        meta = {"started": started, "machine": machine(),
                "postgres": {"version": servers.postgres.version, "settings": servers.postgres.settings},
                "args": {k: v for k, v in vars(args).items()}}
        log(f"servers up: PostgreSQL {servers.postgres.version} in {servers.base}, Tansu on "
            f"{bench.kafka.bootstrap}")
        # The drain cases of ours, the tuned SQL relay and the seeds' loop run interleaved, as one case.
        together = [c for c in THROUGHPUT_CASES if c in args.cases]
        order = []
        for c in args.cases:
            if c in THROUGHPUT_CASES:
                if "+".join(together) not in order:
                    order.append("+".join(together))
            else:
                order.append(c)
        cases: dict[str, Callable[[], None]] = {"+".join(together): lambda: bench.case_throughput(together),
                                                "latency": bench.case_latency, "longtx": bench.case_longtx,
                                                "fleet": lambda: fleet.case_fleet(bench),
                                                "idle": lambda: idle.case_idle(bench),
                                                "enqueue": bench.case_enqueue,
                                                "claim": bench.case_claim, "profile": bench.case_profile,
                                                "projection": lambda: projection_cases.case_projection(bench),
                                                "profile-projection": bench.case_profile_projection,
                                                "rebuild": lambda: projection_cases.case_rebuild(bench),
                                                "write": lambda: write_path.case_write(bench)}
        for case in order:
            # Other work on the machine skews every figure: record how busy it was just before.
            busy = busy_fraction(1.0)
            meta.setdefault("background_busy", {})[case] = round(busy, 3)
            meta.setdefault("loadavg_before", {})[case] = os.getloadavg()[0]
            t = time.monotonic()
            log(f"case {case} ... (machine {100 * busy:.0f}% busy just before, load average {os.getloadavg()[0]:.1f})")
            cases[case]()
            bench.results.setdefault("timings", {})[case] = time.monotonic() - t
            log(f"case {case} done in {time.monotonic() - t:.0f}s")
    meta["total_seconds"] = time.monotonic() - t_start
    text = report(meta, bench.results)
    out = RESULTS / f"bench-{Bench.stamp}.json"
    out.write_text(json.dumps({"meta": meta, "results": bench.results, "table": text}, indent=2, default=str))
    print(text)
    print(f"\n(total {meta['total_seconds']:.0f}s; raw results in {out.relative_to(HERE.parent)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
