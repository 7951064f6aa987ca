"""Two `outbox-relay run` processes given one --worker-id: the second is refused (exit 2, naming the id
and the first one's host and pid) and the first keeps every bucket; a relay restarted with its id right
after a SIGKILL is not refused (its old registration is a previous run's)."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.acceptance.test_relay_processes import Relays, cli, db_rows, owned_buckets
from tests.servers import wait_until

pytestmark = pytest.mark.slow

LONG_TTL = ["--worker-ttl-seconds", "30"]  # a registration that stays fresh through the whole test


def fences(dsn: str) -> int:
    return int(db_rows(dsn, "SELECT coalesce(sum(fence), 0)::bigint FROM outbox.cursors")[0][0])


def test_a_second_relay_with_the_same_id_is_refused(dsn: str, kafka_bootstrap: str, kafka_topic: str,
                                                    relays: Relays) -> None:
    first = relays.start("twin", dsn, kafka_bootstrap, kafka_topic, LONG_TTL)
    wait_until(lambda: owned_buckets(dsn) == {"twin": 256}, 30, 0.2, "the first relay to hold every bucket")
    before = fences(dsn)
    second = relays.start("twin", dsn, kafka_bootstrap, kafka_topic, LONG_TTL)
    try:
        code = second.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the second relay with the same id kept running: {second.stderr()}")
    err = second.stderr()
    assert code == 2, err
    assert (f"worker id 'twin' is in use by another relay (host {socket.gethostname()}, pid {first.proc.pid}"
            in err), err
    assert first.running and owned_buckets(dsn) == {"twin": 256} and fences(dsn) == before
    status = cli(dsn, "status")
    assert status.returncode == 0 and "refused a second relay on host" in status.stdout, status
    assert first.terminate() == 0


def test_a_relay_restarted_right_after_a_crash_takes_its_id_back(dsn: str, kafka_bootstrap: str, kafka_topic: str,
                                                                 relays: Relays) -> None:
    crashed = relays.start("phoenix", dsn, kafka_bootstrap, kafka_topic, LONG_TTL)
    wait_until(lambda: owned_buckets(dsn) == {"phoenix": 256}, 30, 0.2, "the relay to hold every bucket")
    crashed.kill()
    again = relays.start("phoenix", dsn, kafka_bootstrap, kafka_topic, LONG_TTL)
    wait_until(lambda: "started" in again.stderr(), 30, 0.2, "the restarted relay to start")
    assert again.running, again.stderr()
    assert "taking over the registration of a previous run on this host" in again.stderr()
    assert again.terminate() == 0
