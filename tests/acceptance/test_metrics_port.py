"""The metrics port of a real `outbox-relay run` under hostile clients: idle connections past every
bound (with the relay's descriptors limited as the shipped systemd unit used to) stop neither /healthz
nor delivery, nor a reconnect to the database; clients that hang up mid-response leave --log-json
output one JSON object per line."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import struct
import urllib.error
import urllib.request
from pathlib import Path

import psycopg
import pytest

from outbox_relay.housekeeping import application_name
from tests.acceptance.test_relay_processes import Relays, wait_drained
from tests.servers import free_port, wait_until

pytestmark = pytest.mark.slow

DESCRIPTORS = 256  # the relay's RLIMIT_NOFILE here: cheap to exhaust, as 1,024 was under systemd
IDLE_CLIENTS = DESCRIPTORS + 100


def healthz(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=3) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return None


def publish_sql(dsn: str, topic: str, keys: list[str]) -> None:
    """Events as a plain SQL producer writes them."""
    with psycopg.connect(dsn) as conn:
        for key in keys:
            conn.execute("INSERT INTO outbox.events (partition_key, type, topic, payload) VALUES (%s, 't', %s, '{}')",
                         (key, topic))


def start_relay(relays: Relays, name: str, dsn: str, bootstrap: str, topic: str, port: int) -> int:
    relay = relays.start(name, dsn, bootstrap, topic, ["--metrics-port", str(port), "--metrics-host", "127.0.0.1",
                                                       "--log-json"])
    resource.prlimit(relay.proc.pid, resource.RLIMIT_NOFILE, (DESCRIPTORS, DESCRIPTORS))
    wait_until(lambda: healthz(port) == 200, 30, 0.2, "the relay to answer /healthz")
    return relay.proc.pid


def test_idle_connections_to_the_metrics_port_stop_neither_health_nor_delivery(
        dsn: str, kafka_bootstrap: str, kafka_topic: str, relays: Relays) -> None:
    port = free_port()
    start_relay(relays, "flooded", dsn, kafka_bootstrap, kafka_topic, port)
    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE_CLIENTS):  # connections that never send a request
            with contextlib.suppress(OSError):  # refused or timed out: the relay's choice
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=0.2))
        wait_until(lambda: healthz(port) == 200, 30, 0.5, "/healthz to answer while idle clients hold connections")
        publish_sql(dsn, kafka_topic, [f"before-{i}" for i in range(20)])
        wait_drained(dsn, timeout=60)
        # A database restart as the relay sees it: every connection cut; it must open new ones.
        with psycopg.connect(dsn, autocommit=True) as conn:
            cut = conn.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                               "WHERE application_name = %s", (application_name("flooded"),)).fetchone()
        assert cut is not None and cut[0] > 0
        publish_sql(dsn, kafka_topic, [f"after-{i}" for i in range(20)])
        wait_drained(dsn, timeout=60)
        wait_until(lambda: healthz(port) == 200, 30, 0.5, "/healthz after the reconnect")
    finally:
        for s in idle:
            s.close()
    [relay] = relays.started
    assert relay.terminate() == 0


def test_clients_that_hang_up_leave_the_json_log_one_object_per_line(
        dsn: str, kafka_bootstrap: str, kafka_topic: str, relays: Relays, tmp_path: Path) -> None:
    port = free_port()
    start_relay(relays, "hung-up", dsn, kafka_bootstrap, kafka_topic, port)
    for i in range(300):
        with contextlib.suppress(OSError):
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n" if i % 2 else b"GET /healthz HTTP/1.0\r\n\r\n")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            s.close()
    wait_until(lambda: healthz(port) == 200, 30, 0.5, "/healthz after the hang-ups")
    [relay] = relays.started
    assert relay.terminate() == 0
    lines = relay.stderr().splitlines()
    assert lines, "the relay logged nothing"
    not_json = []
    for line in lines:
        try:
            assert isinstance(json.loads(line), dict)
        except (ValueError, AssertionError):
            not_json.append(line)
    assert not not_json, f"{len(not_json)} of {len(lines)} stderr lines are not JSON objects: {not_json[:10]}"
