"""The RabbitMQ server of the tests, and a private namespace per test on it.

The server: ``OUTBOX_TEST_RABBITMQ_URL`` if set, else the machine's broker at 127.0.0.1:5672 (guest/guest),
which our machines and CI start before every session; a test that finds neither is skipped with the reason.
A namespace is a uuid prefix: the test's exchanges and queues carry it and are deleted at its end (a vhost
per test would cost a ``rabbitmqctl`` call of about 2 s each). What needs the broker's administration
(enabling a plugin, restarting the broker) is done with ``rabbitmqctl`` / ``rabbitmq-plugins`` when the
tests run as root next to a local broker (``admin_available``), else those tests are skipped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from outbox_relay.sinks.rabbitmq.message import CE_PREFIX
from tests.servers import wait_until

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
CONSISTENT_HASH_PLUGIN = "rabbitmq_consistent_hash_exchange"


def rabbitmq_url() -> str:
    return os.environ.get("OUTBOX_TEST_RABBITMQ_URL", DEFAULT_URL)


def connect(url: str | None = None) -> Any:
    """A pika BlockingConnection to the test server (the tests' own: never through a fault proxy)."""
    import pika

    return pika.BlockingConnection(pika.URLParameters(url or rabbitmq_url()))


def require_server() -> str:
    url = rabbitmq_url()
    try:
        connect(url).close()
    except Exception as exc:
        pytest.skip(f"no RabbitMQ at {urllib.parse.urlsplit(url).hostname}:{urllib.parse.urlsplit(url).port} "
                    f"(set OUTBOX_TEST_RABBITMQ_URL): {type(exc).__name__}")
    return url


def admin_available() -> str | None:
    """None if this process may administer the broker (root, rabbitmqctl, a local broker), else why not."""
    host = urllib.parse.urlsplit(rabbitmq_url()).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        return f"the test broker ({host}) is not local"
    if os.geteuid() != 0:
        return "rabbitmqctl needs root here"
    if shutil.which("rabbitmqctl") is None or shutil.which("rabbitmq-plugins") is None:
        return "no rabbitmqctl / rabbitmq-plugins on PATH"
    return None


def _run(*argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def require_consistent_hash() -> None:
    """The consistent-hash exchange type, enabled here if it is not (as root), else the test is skipped."""
    if _exchange_type_known("x-consistent-hash"):
        return
    why = admin_available()
    if why is not None:
        pytest.skip(f"the {CONSISTENT_HASH_PLUGIN} plugin is not enabled and can not be here: {why}")
    done = _run("rabbitmq-plugins", "enable", CONSISTENT_HASH_PLUGIN)
    if done.returncode != 0:
        pytest.skip(f"rabbitmq-plugins enable {CONSISTENT_HASH_PLUGIN} failed: {done.stderr.strip()[-300:]}")
    wait_until(lambda: _exchange_type_known("x-consistent-hash"), timeout=30, interval=0.2,
               message="the consistent-hash exchange type to be known")


def _exchange_type_known(kind: str) -> bool:
    import pika

    name = f"probe-{uuid.uuid4().hex[:12]}"
    conn = connect()
    try:
        channel = conn.channel()
        channel.exchange_declare(name, kind, auto_delete=True)
        channel.exchange_delete(name)
        return True
    except pika.exceptions.AMQPError:  # 503 COMMAND_INVALID "unknown exchange type" closes the connection
        return False
    finally:
        if conn.is_open:
            conn.close()


def restart_broker() -> None:
    """``rabbitmqctl stop_app`` then ``start_app``: every connection is closed, durable queues and persistent
    messages survive."""
    for step in ("stop_app", "start_app"):
        done = _run("rabbitmqctl", step)
        assert done.returncode == 0, f"rabbitmqctl {step}: {done.stderr[-500:]}"
    wait_until(_answers, timeout=60, interval=0.2, message="RabbitMQ to accept connections again")


def _answers() -> bool:
    try:
        connect().close()
        return True
    except Exception:
        return False


@dataclass
class Namespace:
    """Exchanges and queues of one test, named ``<prefix>-<name>``, deleted at the end."""

    prefix: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:10]}")
    exchanges: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)

    def name(self, what: str) -> str:
        return f"{self.prefix}-{what}"

    def exchange(self, what: str, kind: str = "direct", **arguments: Any) -> str:
        name = self.name(what)
        with channel() as ch:
            ch.exchange_declare(name, kind, durable=True, arguments=arguments or None)
        self.exchanges.append(name)
        return name

    def queue(self, what: str, *, bind: str | None = None, routing_key: str = "#", **arguments: Any) -> str:
        """A durable classic queue, bound to exchange ``bind`` with ``routing_key`` if given."""
        name = self.name(what)
        with channel() as ch:
            ch.queue_declare(name, durable=True, arguments=arguments or None)
            if bind is not None:
                ch.queue_bind(name, bind, routing_key)
        self.queues.append(name)
        return name

    def bind(self, queue: str, exchange: str, routing_key: str) -> None:
        with channel() as ch:
            ch.queue_bind(queue, exchange, routing_key)

    def delete(self) -> None:
        with channel() as ch:
            for queue in self.queues:
                ch.queue_delete(queue)
            for exchange in self.exchanges:
                ch.exchange_delete(exchange)


@contextlib.contextmanager
def channel() -> Iterator[Any]:
    conn = connect()
    try:
        yield conn.channel()
    finally:
        if conn.is_open:
            conn.close()


@dataclass(frozen=True)
class Received:
    id: uuid.UUID
    key: str
    queue: str
    properties: Any
    body: bytes
    exchange: str


def take_all(queue: str) -> list[Received]:
    """Every message in ``queue``, consumed (acknowledged), in queue order."""
    got: list[Received] = []
    with channel() as ch:
        while True:
            method, properties, body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                return got
            headers = properties.headers or {}
            got.append(Received(uuid.UUID(str(headers.get(f"{CE_PREFIX}id", properties.message_id))),
                                method.routing_key, queue, properties, body, method.exchange))


def message_count(queue: str) -> int:
    with channel() as ch:
        return int(ch.queue_declare(queue, passive=True).method.message_count)
