"""One fault-injection run, start to finish: servers, relays, load, faults, drain, check, report."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from tests.faults import checker, cluster, report
from tests.faults.cluster import Broker, Database, Fleet, backlog, create_topic, owned_buckets
from tests.faults.faults import DEFAULT_KINDS, INJECTORS, NEEDS_RESTARTABLE_DB, Lab, plan
from tests.faults.proxy import Proxy, exempt_kafka_clients
from tests.faults.recorder import Recorder

log = logging.getLogger("tests.faults")

TOPIC = "faults"
SINK = "kafka"
HEALTH_WINDOW = 1.0  # seconds of recent commits the health probe looks at


@dataclass
class Config:
    seconds: float = 120.0
    faults: int = 50
    relays: int = 4
    seed: int = 0
    report: Path | None = None
    json_path: Path | None = None  # machine-readable summary (the CI test reads it)
    sabotage_lose: int = 0  # testing the suite itself: the recorder ignores 1 in N events
    rate: float = 300.0  # events/s over all producers
    keys: int = 600
    producers: int = 2  # processes (each with --producer-threads threads)
    producer_threads: int = 4
    partitions: int = 4
    threshold: float = 1.0  # an event consumed later than this after its commit is late
    max_wait: float = 30.0  # longest wait for delivery to recover before the next fault anyway
    drain_timeout: float = 180.0
    kinds: list[str] = field(default_factory=lambda: list(DEFAULT_KINDS))
    starve: int = 0  # relay_starve faults added to the plan (tests/faults/starve.py)
    dsn: str | None = None  # external PostgreSQL (no database restarts)
    workdir: Path | None = None
    keep: bool = False
    relay_options: list[str] = field(default_factory=list)
    command: str = ""


@dataclass
class Outcome:
    result: checker.Result
    report: str
    passed: bool
    workdir: Path


class Producers:
    """The producer processes (tests/faults/producer.py), each owning its share of the keys."""

    def __init__(self, config: Config, dsn: str, log_dir: Path) -> None:
        keys = [f"k{i:04d}" for i in range(config.keys)]
        self.procs: list[subprocess.Popen[str]] = []
        self.summaries: list[dict[str, Any]] = []
        for p in range(config.producers):
            err = (log_dir / f"producer-{p}.log").open("w")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.faults.producer", "--dsn", dsn, "--topic", TOPIC, "--producer", str(p),
                 "--keys", ",".join(keys[p::config.producers]), "--threads", str(config.producer_threads),
                 "--rate", str(config.rate / config.producers), "--seed", str(config.seed * 100 + p)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True))
            err.close()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for i, p in enumerate(self.procs):
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            line = (out or "").strip().splitlines()[-1:] or ["{}"]
            try:
                summary = json.loads(line[0])
            except ValueError:
                summary = {}
            summary.update(producer=i, exit_code=p.returncode)
            self.summaries.append(summary)
        return self.summaries


class Health:
    """Is delivery healthy now? Every event committed in the last ``HEALTH_WINDOW`` seconds
    before ``now - threshold`` (and after ``since``) has been consumed, and there was one."""

    def __init__(self, database: Database, recorder: Recorder, threshold: float) -> None:
        self.database = database
        self.recorder = recorder
        self.threshold = threshold
        self._conn: psycopg.Connection[Any] | None = None

    def healthy(self, since: float) -> bool:
        try:
            if self._conn is None or self._conn.closed:
                self._conn = self.database.connect()
            rows = self._conn.execute(
                "SELECT id::text FROM outbox.events "
                "WHERE created_at >= greatest(to_timestamp(%(since)s), now() - make_interval(secs => %(old)s)) "
                "  AND created_at < now() - make_interval(secs => %(young)s)",
                {"since": since, "old": self.threshold + HEALTH_WINDOW, "young": self.threshold}).fetchall()
        except psycopg.Error:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            return False
        ids = [r[0] for r in rows]
        return bool(ids) and not self.recorder.missing(ids)

    def wait(self, since: float, timeout: float) -> float | None:
        """Seconds until healthy (polled), or None if it was not within ``timeout``."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.healthy(since):
                return time.monotonic() - started
            time.sleep(0.1)
        return None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def say(text: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run(config: Config) -> Outcome:
    kinds = list(config.kinds)
    workdir = config.workdir or Path(tempfile.mkdtemp(prefix="outbox-faults-"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "relays").mkdir(exist_ok=True)
    rnd = random.Random(config.seed)
    notes: list[str] = []
    started_at, loadavg_start = time.time(), _loadavg()
    with contextlib.ExitStack() as stack:
        say(f"work directory {workdir}")
        database = Database(config.dsn)
        stack.callback(database.close, config.keep)
        if not database.restartable and NEEDS_RESTARTABLE_DB & set(kinds):
            kinds = [k for k in kinds if k not in NEEDS_RESTARTABLE_DB]
            notes.append("the database is external (not restartable): no db_restart faults")
        say(f"PostgreSQL {database.version} ({database.server.kind}), synchronous_commit={database.synchronous_commit}")
        migrated = subprocess.run([sys.executable, "-m", "outbox_relay.cli", "migrate"], capture_output=True,
                                  text=True, env={**os.environ, "OUTBOX_DSN": database.dsn}, timeout=120)
        if migrated.returncode != 0:
            raise RuntimeError(f"outbox-relay migrate failed: {migrated.stderr}")

        kafka_proxy = Proxy("kafka", ("127.0.0.1", 0), exempt=exempt_kafka_clients("faults-")).start()
        stack.callback(kafka_proxy.close)
        broker = Broker(workdir, kafka_proxy.port)
        kafka_proxy.upstream = ("127.0.0.1", broker.port)
        broker.start()
        stack.callback(broker.kill)
        create_topic(kafka_proxy.address, TOPIC, config.partitions)

        db_proxies = [Proxy(f"pg-{slot}", database.upstream).start() for slot in range(config.relays)]
        for p in db_proxies:
            stack.callback(p.close)

        recorder = Recorder(kafka_proxy.address, TOPIC, config.partitions, ignore_one_in=config.sabotage_lose)
        recorder.begin_incarnation()
        stack.callback(recorder.stop)

        fleet = Fleet(workdir / "relays", [database.relay_dsn(p.port, slot) for slot, p in enumerate(db_proxies)],
                      kafka_proxy.address, TOPIC, list(config.relay_options))
        stack.callback(fleet.kill_all)
        for slot in range(config.relays):
            fleet.start(slot)
        with database.connect() as conn:
            def shared() -> bool:
                owned = owned_buckets(conn, SINK)
                return len(owned) == config.relays and sum(owned.values()) == 256
            _wait(shared, 60, f"{config.relays} relays sharing the 256 buckets")
        say(f"{config.relays} relays share the buckets; broker {broker.version()}")

        producers = Producers(config, database.dsn, workdir)
        stack.callback(producers.kill)
        health = Health(database, recorder, config.threshold)
        stack.callback(health.close)
        lab = Lab(rnd, database, broker, kafka_proxy, db_proxies, fleet, recorder, TOPIC, config.partitions)

        phase_started = time.time()
        faults, waits, unexpected = _inject(config, kinds, lab, health, producers, phase_started)
        phase_seconds = time.time() - phase_started
        summaries = producers.stop()
        say(f"producers stopped: {sum(int(s.get('events', 0)) for s in summaries)} events published")

        drained_after = _drain(database, config.drain_timeout)
        found = recorder.drain(quiet=2.0, timeout=120)
        recorder.finish()
        say(f"final re-read found {found} records the live consumer had not seen")
        lag_cli = subprocess.run([sys.executable, "-m", "outbox_relay.cli", "lag", "--json"], capture_output=True,
                                 text=True, env={**os.environ, "OUTBOX_DSN": database.dsn}, timeout=60)
        committed, dead = _load(database)
        _dump(workdir, committed, recorder.records, faults)
        result = checker.check(committed, dead, recorder.records, faults, threshold=config.threshold)
        exit_codes = fleet.stop_all()
        unexpected += [(r.worker_id, r.proc.returncode) for r in fleet.unexpected_exits()]
        passed = (result.passed and drained_after is not None and not unexpected and not lab.findings
                  and all(code == 0 for code in exit_codes.values()))
        text = report.render(
            config=config, kinds=kinds, result=result, faults=faults, waits=waits, notes=notes, findings=lab.findings,
            database=database, broker_version=broker.version(), recorder_stats=recorder.stats,
            incarnations=recorder.incarnation + 1, producers=summaries, drained_after=drained_after,
            lag_json=lag_cli.stdout if lag_cli.returncode == 0 else lag_cli.stderr,
            relay_exit_codes=exit_codes, unexpected=unexpected, t0=phase_started, phase_seconds=phase_seconds,
            relay_logs=report.scan_logs(workdir / "relays"), workdir=workdir,
            proxy_stats={p.name: vars(p.stats) for p in [kafka_proxy, *db_proxies]}, passed=passed,
            started_at=started_at, loadavg=(loadavg_start, _loadavg()), lease_seconds=cluster.LEASE_SECONDS)
        if config.report is not None:
            config.report.write_text(text)
        if config.json_path is not None:
            config.json_path.write_text(json.dumps(summary(result, faults, passed, phase_seconds, kinds, database),
                                                      indent=2))
        return Outcome(result, text, passed, workdir)


def summary(result: checker.Result, faults: list[checker.Fault], passed: bool, phase_seconds: float,
            kinds: list[str], database: Database) -> dict[str, Any]:
    return {
        "passed": passed,
        "database": database.server.kind,
        "kinds_planned": kinds,
        "problems": result.problems(),
        "phase_seconds": round(phase_seconds, 1),
        "committed": result.committed, "consumed": result.consumed, "distinct": result.distinct,
        "lost": len(result.lost), "dead_lettered": len(result.dead_lettered),
        "phantoms": len(result.phantoms) + len(result.mismatched), "reordered_keys": len(result.reordered),
        "duplicate_rate": round(result.duplicate_rate, 4),
        "duplicates_percent": round(result.duplicates_percent, 2),
        "wait_after_end_max": round(max((fr.wait_after_end for fr in result.faults), default=0.0), 2),
        "starve_wait_after_end": [round(fr.wait_after_end, 2) for fr in result.faults
                                  if fr.fault.kind == "relay_starve"],
        "stalls": [vars(st) for st in result.stalls],
        "faults": [{"kind": f.kind, "target": f.target, "detail": f.detail} for f in faults],
        "kinds": [vars(k) for k in result.kinds],
        "lost_examples": [vars(x) for x in result.lost[:20]],
    }


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def _inject(config: Config, kinds: list[str], lab: Lab, health: Health, producers: Producers, t0: float
            ) -> tuple[list[checker.Fault], list[float | None], list[tuple[str, int | None]]]:
    """Inject the planned faults, spread over ``config.seconds``; each waits until delivery
    recovered from the previous one (at most ``max_wait``), so it can be attributed."""
    order = plan(kinds, config.faults, random.Random(config.seed), starve=config.starve)
    gap = config.seconds / (len(order) + 1)
    say(f"load running; {len(order)} faults over {config.seconds:.0f}s (one every {gap:.1f}s at most): "
        + ", ".join(f"{k} x{order.count(k)}" for k in INJECTORS if order.count(k)))
    phase_started = time.monotonic()
    faults: list[checker.Fault] = []
    waits: list[float | None] = []  # seconds each fault waited for delivery to recover from the previous
    unexpected: list[tuple[str, int | None]] = []
    since = time.time()
    regular = 0  # faults other than relay_starve so far: their random streams match a run without starvation
    for i, kind in enumerate(order):
        planned = phase_started + (i + 1) * gap
        time.sleep(max(0.0, planned - time.monotonic()))
        if any(s.running for s in lab.starving):
            waited = None  # the other faults go on while the relays are starved, on their schedule
        else:
            waited = health.wait(since, config.max_wait)
            if waited is None:
                say(f"delivery not healthy {config.max_wait:.0f}s after fault {i - 1}: injecting the next one anyway")
        waits.append(waited)
        for relay in lab.fleet.unexpected_exits():
            unexpected.append((relay.worker_id, relay.proc.returncode))
            say(f"relay {relay.worker_id} exited on its own with {relay.proc.returncode}; starting a new one")
            lab.fleet.start(relay.slot)
        if not producers.alive():
            raise RuntimeError("a producer process died; see producer-*.log in the work directory")
        # One stream per fault: its target and durations do not depend on what earlier faults drew.
        lab.rnd = random.Random(config.seed * 1000 + (regular if kind != "relay_starve" else 10_000 + i))
        regular += kind != "relay_starve"
        lab.ends_at = None
        started = time.time()
        target, detail = INJECTORS[kind](lab)
        since = time.time()
        ended = lab.ends_at or since
        faults.append(checker.Fault(i, kind, target, detail, started, ended, healthy_before=waited is not None))
        say(f"fault {i:2d} at {started - t0:6.1f}s: {kind} {target}: {detail}")
    for starver in lab.starving:  # over before the last health check and the drain
        starver.join()
        since = max(since, starver.ends_at)
    waited = health.wait(since, config.max_wait)
    waits.append(waited)
    return faults, waits, unexpected


def _drain(database: Database, timeout: float) -> float | None:
    """Wait until the relays report nothing pending or parked; seconds it took, or None."""
    started = time.monotonic()
    last: tuple[int, int] | None = None
    while time.monotonic() - started < timeout:
        try:
            with database.connect() as conn:
                last = backlog(conn, SINK)
            if last == (0, 0):
                say(f"relays drained in {time.monotonic() - started:.1f}s")
                return time.monotonic() - started
        except psycopg.Error:
            pass
        time.sleep(0.5)
    say(f"relays did NOT drain within {timeout:.0f}s: (pending, parked) = {last}")
    return None


def _load(database: Database) -> tuple[list[checker.Committed], list[checker.DeadLetter]]:
    with database.connect() as conn:
        events = conn.execute(
            "SELECT id::text, partition_key, (payload->>'producer')::int, (payload->>'n')::int, "
            "extract(epoch FROM created_at)::float8 FROM outbox.events").fetchall()
        dead = conn.execute("SELECT event_id::text, sink, attempts, last_error FROM outbox.dead_letters").fetchall()
    return ([checker.Committed(str(r[0]), str(r[1]), int(r[2]), int(r[3]), float(r[4])) for r in events],
            [checker.DeadLetter(str(r[0]), str(r[1]), int(r[2]), str(r[3])) for r in dead])


def _dump(workdir: Path, committed: list[checker.Committed], records: list[Any], faults: list[checker.Fault]
          ) -> None:
    """The raw data, one JSON object a line, for questions the report does not answer."""
    for name, rows in (("committed", committed), ("records", records), ("faults", faults)):
        with (workdir / f"{name}.jsonl").open("w") as out:
            for row in rows:
                out.write(json.dumps(dataclasses.asdict(row)) + "\n")


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"
