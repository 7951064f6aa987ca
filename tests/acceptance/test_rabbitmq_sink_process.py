"""Acceptance: `outbox-relay run --rabbitmq-url ...` as a process, killed with SIGKILL mid-stream and started
again, then the broker restarted (``rabbitmqctl stop_app`` / ``start_app``) while the relay publishes and a
producer writes. What the broker holds at the end (read back, put back) has every published event, and each
key's de-duplicated sequence is the published one; the relay drains on SIGTERM and exits 0.

Duplicates are allowed: the killed relay's last batch is published again by its successor, and a publish
whose confirm the restart cut off is sent again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import uuid
from collections import defaultdict
from pathlib import Path

import psycopg
import pytest

from outbox_relay import Outbox
from outbox_relay.rabbitmq_settings import RabbitMQSettings
from outbox_relay.sinks.rabbitmq.readback import read_back
from tests.acceptance.test_user_sink_run import FAST, command
from tests.rabbitmq_server import Namespace, admin_available, message_count, require_server, restart_broker
from tests.servers import wait_until

pytestmark = pytest.mark.slow

KEYS = [f"order:{i}" for i in range(16)]


class Producer:
    """Publishes batches of events (one transaction each) on a thread until stopped; ids per key in order."""

    def __init__(self, dsn: str, topic: str) -> None:
        self.dsn = dsn
        self.outbox = Outbox(default_topic=topic)
        self.published: dict[str, list[uuid.UUID]] = defaultdict(list)
        self.stop = threading.Event()
        self.count = 0
        self._thread = threading.Thread(target=self._run, name="producer")

    def batch(self, n: int) -> None:
        events = [{"key": KEYS[(self.count + i) % len(KEYS)], "type": "OrderPlaced", "payload": {"n": self.count + i}}
                  for i in range(n)]
        with psycopg.connect(self.dsn) as conn:
            for e, p in zip(events, self.outbox.publish_many(conn, events), strict=True):
                self.published[str(e["key"])].append(p.id)
        self.count += n

    def _run(self) -> None:
        while not self.stop.wait(0.02):  # a steady trickle: about 1,000 events/s at most
            self.batch(20)

    def __enter__(self) -> Producer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(30)


def held(queue: str) -> int:
    """Messages in ``queue`` (0 while the broker does not answer)."""
    try:
        return message_count(queue)
    except Exception:
        return 0


def start(dsn: str, url: str, tmp_path: Path, worker_id: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OUTBOX_DSN": dsn, "OUTBOX_RABBITMQ_URL": url, "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / f"{worker_id}.stderr").open("wb")
    with log:
        return subprocess.Popen([*command(), "run", "--worker-id", worker_id, *FAST, "--no-kafka",
                                 "--rabbitmq-unavailable-seconds", "0.2", "--rabbitmq-concurrency", "4",
                                 "--rabbitmq-heartbeat-seconds", "5", "--backoff-base-seconds", "0.05",
                                 "--backoff-max-seconds", "0.5"],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)


def tail(tmp_path: Path) -> str:
    return "\n".join(f"{p.name}: {p.read_text()[-1500:]}" for p in sorted(tmp_path.glob("*.stderr")))


def test_relay_killed_and_broker_restarted_mid_stream_loses_nothing_and_keeps_each_keys_order(
        dsn: str, tmp_path: Path) -> None:
    url = require_server()
    why = admin_available()
    if why is not None:
        pytest.skip(f"restarting RabbitMQ needs rabbitmqctl as root next to it: {why}")
    ns = Namespace()
    relays: list[subprocess.Popen[bytes]] = []
    try:
        orders = ns.exchange("orders", "topic")
        queue = ns.queue("orders", bind=orders)  # durable: it and its persistent messages survive the restart
        with Producer(dsn, orders) as producer:
            relays.append(start(dsn, url, tmp_path, "rmq-a"))
            wait_until(lambda: held(queue) >= 200, timeout=30, message="the first messages")
            relays[0].send_signal(signal.SIGKILL)  # mid-stream: the producer goes on
            relays[0].wait(10)
            relays.append(start(dsn, url, tmp_path, "rmq-b"))
            before = held(queue)
            wait_until(lambda: held(queue) >= before + 200, timeout=30,
                       message="the second relay publishing")
            restart_broker()  # mid-stream again: the relay's connections are closed under it
            after = held(queue)
            wait_until(lambda: held(queue) >= after + 200, timeout=30,
                       message="publishing after the restart")
        total = producer.count
        fields = RabbitMQSettings(rabbitmq_url=url, rabbitmq_queues=[queue])
        wanted = {i for ids in producer.published.values() for i in ids}
        wait_until(lambda: wanted <= {i for i, _, _ in read_back(fields)}, timeout=60, interval=0.5,
                   message=f"all {total} events in the queue")
        relays[1].send_signal(signal.SIGTERM)
        assert relays[1].wait(30) == 0, tail(tmp_path)
        got: dict[str, list[uuid.UUID]] = defaultdict(list)
        for event_id, key, _ in read_back(fields):
            if event_id not in got[key]:
                got[key].append(event_id)
        assert dict(got) == dict(producer.published), "per key, the de-duplicated sequence is the published one"
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{tail(tmp_path)}") from None
    finally:
        for relay in relays:
            if relay.poll() is None:
                relay.kill()
                relay.wait(10)
        ns.delete()
