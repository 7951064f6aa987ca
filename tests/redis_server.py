"""Redis servers for the tests: the machine's (shared: every test writes under a prefix of its own and
deletes its keys) and private ``redis-server`` processes (a test that restarts, stops or reconfigures
the server, or needs a password or TLS).

- shared: ``OUTBOX_TEST_REDIS_URL``, else redis://127.0.0.1:6379/0; the tests are skipped if it does
  not answer.
- private: ``/usr/bin/redis-server`` (or ``OUTBOX_TEST_REDIS_SERVER``) on a free port with its own
  directory, ``appendonly yes`` and ``appendfsync always``, so that a restart (even after SIGKILL)
  keeps every acknowledged entry.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import free_port, wait_until

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def shared_url() -> str:
    """The shared server's URL; the test is skipped if it does not answer."""
    import redis

    url = os.environ.get("OUTBOX_TEST_REDIS_URL", DEFAULT_URL)
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {url.split('@')[-1]}: {exc}")
    finally:
        client.close()
    return url


@contextlib.contextmanager
def namespace(url: str) -> Iterator[str]:
    """A key prefix of one test (``outbox-test:<uuid>:``); its keys are deleted at the end."""
    import redis

    prefix = f"outbox-test:{uuid.uuid4().hex[:12]}:"
    try:
        yield prefix
    finally:
        client = redis.Redis.from_url(url)
        try:
            keys = list(client.scan_iter(match=prefix + "*", count=1000))
            if keys:
                client.delete(*keys)
        finally:
            client.close()


class PrivateRedis:
    """A ``redis-server`` of one test in ``directory``: ``start``, ``kill`` (SIGKILL), ``stop`` (SIGSTOP /
    SIGCONT with ``pause``), on one port throughout, so that a client's URL stays valid."""

    def __init__(self, directory: Path, *args: str, tls: tuple[Path, Path] | None = None) -> None:
        self.binary = (os.environ.get("OUTBOX_TEST_REDIS_SERVER") or shutil.which("redis-server")
                       or "/usr/bin/redis-server")
        if not Path(self.binary).exists():
            pytest.skip("no redis-server binary")
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.args = list(args)
        self.tls = tls  # (certificate, key): TLS only, on ``port``, the certificate its own CA
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"rediss://localhost:{self.port}/0" if self.tls else f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> Any:
        import redis

        if self.tls:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls[0]))
        return redis.Redis(host="localhost" if self.tls else "127.0.0.1", port=self.port, **kwargs)

    def listen_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        cert, key = (str(p) for p in self.tls)
        return ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert, "--tls-key-file", key,
                "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]

    def start(self) -> PrivateRedis:
        assert self.process is None or self.process.poll() is not None
        log = (self.directory / "redis.log").open("ab")
        self.process = subprocess.Popen(
            [self.binary, *self.listen_args(), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no", *self.args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        wait_until(self._answers, timeout=15, message=f"redis-server on port {self.port}")
        return self

    def _answers(self) -> bool:
        import redis

        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"redis-server exited: {(self.directory / 'redis.log').read_text()[-2000:]}")
        client = self.client(socket_connect_timeout=1, socket_timeout=1, **self.auth())
        try:
            return bool(client.ping())
        except redis.exceptions.BusyLoadingError:
            return False
        except redis.exceptions.ConnectionError:
            return False
        finally:
            client.close()

    def auth(self) -> dict[str, str]:
        """The credentials the server was started with (``--requirepass``), for its own checks."""
        if "--requirepass" in self.args:
            return {"password": self.args[self.args.index("--requirepass") + 1]}
        return {}

    def kill(self) -> None:
        """SIGKILL: what was acknowledged is in the append-only file (appendfsync always)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The server stopped (SIGSTOP): connections open, no answers, until the block ends."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@contextlib.contextmanager
def private_redis(directory: Path, *args: str, tls: tuple[Path, Path] | None = None) -> Iterator[PrivateRedis]:
    server = PrivateRedis(directory, *args, tls=tls).start()
    try:
        yield server
    finally:
        server.close()
