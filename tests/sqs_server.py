"""An SQS endpoint for the tests: moto's server mode over HTTP, a subprocess of the test session.

``OUTBOX_TEST_SQS_URL`` points the tests at another endpoint instead (LocalStack, a real account with
``AWS_*`` in the environment); the tests that restart the endpoint always start their own. Every test
works in queues of its own (a uuid prefix) and deletes them. moto keeps no state: a restart empties it.

Run as a script, this file is the server: moto's own ``main`` after three patches (moto 5.2) that
change no answer moto gives:

- a send stays cheap: moto computes every queue attribute (three of them by scanning all messages)
  each time it looks up ``ContentBasedDeduplication`` while sending, which makes a send cost
  O(messages in the queue): 20 messages/s at 600 queued. While a send runs, the patch leaves the
  counts out of that lookup (GetQueueAttributes still counts).
- a receive stays cheap: moto reads every attribute again for each message it hands out (to check
  its retention period): a receive of 10 took a second at 1,000 queued. The patch reads the one.
- a delete takes the lock a send takes: moto's delete rebuilds the queue's message list and assigns it
  without that lock, so messages sent meanwhile were lost (550 of 600 in a run with one sender and
  one reader receiving and deleting).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# read_back's long polling, in seconds: moto answers a short poll exactly (SQS may not: 1 against another endpoint).
QUIET = 1 if os.environ.get("OUTBOX_TEST_SQS_URL") else 0
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret-not-shown",
                     "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """``python tests/sqs_server.py -p PORT`` as a subprocess; ``stop``/``start`` again on the same port."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> MotoServer:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen([sys.executable, __file__, "-H", "127.0.0.1", "-p", str(self.port)],
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1):
                    return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto did not start: {self.log_path.read_text()[-2000:]}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self.process = None

    def pause(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGCONT)


@contextlib.contextmanager
def moto_server(log_path: Path) -> Iterator[MotoServer]:
    server = MotoServer(log_path).start()
    try:
        yield server
    finally:
        with contextlib.suppress(Exception):
            server.resume()
        server.kill()


def use_dummy_credentials(monkeypatch: Any) -> None:
    """The moto endpoint takes any credentials; set these unless the environment points at another one."""
    for name, value in DUMMY_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)


def client(url: str, service: str = "sqs") -> Any:
    """A client signed with the credentials the environment holds now (a session of its own: boto3's
    default session keeps the first ones it found)."""
    import boto3

    return boto3.session.Session().client(service, endpoint_url=url,
                                          region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))


class Namespace:
    """Queues of one test: names start with ``prefix``; ``create`` makes one, ``close`` deletes them all."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.prefix = f"t{uuid.uuid4().hex[:10]}-"
        self.sqs = client(url)

    def iam(self) -> Any:
        return client(self.url, "iam")

    def name(self, topic: str, fifo: bool = True) -> str:
        return f"{self.prefix}{topic}" + (".fifo" if fifo else "")

    def create(self, topic: str, fifo: bool = True, **attributes: str) -> str:
        attrs = {"FifoQueue": "true", **attributes} if fifo else dict(attributes)
        return str(self.sqs.create_queue(QueueName=self.name(topic, fifo), Attributes=attrs)["QueueUrl"])

    def delete(self, topic: str, fifo: bool = True) -> None:
        url = self.sqs.get_queue_url(QueueName=self.name(topic, fifo))["QueueUrl"]
        self.sqs.delete_queue(QueueUrl=url)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            for url in self.sqs.list_queues(QueueNamePrefix=self.prefix).get("QueueUrls", []):
                self.sqs.delete_queue(QueueUrl=url)
        self.sqs.close()


# -- the server (run as a script) --------------------------------------------------------------


def _patched_moto() -> Callable[[], Any]:
    from moto.core.utils import unix_time
    from moto.server import main
    from moto.sqs import models

    full: Callable[[Any], dict[str, Any]] = models.Queue.attributes.fget  # type: ignore[attr-defined]
    sending = threading.local()

    def attributes(queue: Any) -> dict[str, Any]:
        if getattr(sending, "depth", 0):
            value = getattr(queue, "content_based_deduplication", None) if queue.fifo_queue else None
            return {} if value is None else {"ContentBasedDeduplication": str(value).lower()}
        return full(queue)

    def while_sending(method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            sending.depth = getattr(sending, "depth", 0) + 1
            try:
                return method(*args, **kwargs)
            finally:
                sending.depth -= 1
        return wrapper

    models.Queue.attributes = property(attributes)  # type: ignore[assignment,method-assign]
    def retained(backend: Any, queue_name: str, message: Any) -> bool:
        period = int(backend.get_queue(queue_name).message_retention_period)
        return bool(period + message.sent_timestamp / 1000 > unix_time())

    models.SQSBackend.is_message_valid_based_on_retention_period = retained  # type: ignore[method-assign]
    delete = models.Queue.delete_message

    def delete_message(queue: Any, receipt_handle: str) -> None:
        with queue._messages_lock:  # add_message appends under it
            delete(queue, receipt_handle)

    models.Queue.delete_message = delete_message  # type: ignore[method-assign]
    for cls, name in ((models.SQSBackend, "_validate_message"), (models.SQSBackend, "send_message"),
                      (models.Queue, "add_message")):
        setattr(cls, name, while_sending(getattr(cls, name)))
    return main


if __name__ == "__main__":
    sys.exit(_patched_moto()())
