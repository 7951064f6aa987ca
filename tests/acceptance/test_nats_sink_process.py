"""Acceptance: ``outbox-relay run --nats-url ...`` as a process, killed with SIGKILL mid-stream and started again,
while the nats-server is killed and started again (same port and data directory) mid-stream too. Then what the
stream holds (read_back): every event, each key in publish order, and no duplicate at all (the stream's
duplicate window, Nats-Msg-Id = event id, drops the redeliveries the crash causes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from outbox_relay.nats_settings import NatsSettings
from outbox_relay.sinks.nats.readback import read_back
from tests.acceptance.test_user_sink_run import FAST, command
from tests.integration.relay_helpers import publish
from tests.nats_server import PrivateNats, namespace
from tests.servers import wait_until

pytestmark = pytest.mark.slow

EVENTS = 3000
KEYS = 20


def start(dsn: str, tmp_path: Path, server: PrivateNats, prefix: str, worker: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OUTBOX_DSN": dsn, "PYTHONUNBUFFERED": "1"}
    with (tmp_path / f"{worker}.stderr").open("wb") as err:
        return subprocess.Popen([*command(), "run", "--worker-id", worker, *FAST, "--no-kafka", "--batch-size", "100",
                                 "--nats-url", server.url, "--nats-subject-prefix", prefix,
                                 "--nats-connect-timeout-seconds", "1"],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)


def test_relay_and_server_killed_mid_stream_lose_nothing_reorder_nothing_duplicate_nothing(
        dsn: str, tmp_path: Path) -> None:
    if os.environ.get("OUTBOX_TEST_NATS_URL"):
        pytest.skip("kills its own private nats-server")
    (tmp_path / "nats").mkdir()
    server = PrivateNats(tmp_path / "nats").start()
    relay: subprocess.Popen[bytes] | None = None
    try:
        with namespace(server.url) as space:
            fields = NatsSettings(nats_url=server.url, nats_subject_prefix=space.prefix)
            keys = [f"order:{i % KEYS}" for i in range(EVENTS)]
            ids = publish(dsn, [(k, "OrderPlaced", {"n": n}) for n, k in enumerate(keys)])

            def held() -> int:
                return space.messages() if server.running() else -1

            relay = start(dsn, tmp_path, server, space.prefix, "nats-a")
            wait_until(lambda: held() >= 300, 60, 0.02, "the first events in the stream")
            relay.kill()  # SIGKILL: published batches not checkpointed are sent again by the next relay
            relay.wait(10)
            assert held() < EVENTS, "killed before the end"
            relay = start(dsn, tmp_path, server, space.prefix, "nats-b")
            already = held()
            wait_until(lambda: held() >= already + 300, 60, 0.02, "delivery after the relay's restart")
            at_kill = held()
            server.kill()  # the broker too, mid-stream (its file storage stays)
            assert at_kill < EVENTS and relay.poll() is None, "the server killed before the end"
            server.start()
            wait_until(lambda: held() == EVENTS, 90, 0.2,
                       f"every event in the stream; relay: {(tmp_path / 'nats-b.stderr').read_text()[-3000:]}")
            got = read_back(fields)
            status = subprocess.run([*command(), "status", "--json"], env={**os.environ, "OUTBOX_DSN": dsn},
                                    capture_output=True, text=True, timeout=60)
            assert status.returncode == 0, status.stderr
            assert {r["sink"]: r["kind"] for r in json.loads(status.stdout)["backlog"]}.get("nats") == "nats"
        assert relay.poll() is None, "the relay rode out the server's restart"
        assert "disconnected from" in (tmp_path / "nats-b.stderr").read_text()
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(30) == 0
    finally:
        if relay is not None and relay.poll() is None:
            relay.kill()
            relay.wait(10)
        server.close()
    received = [i for i, _, _ in got]
    assert len(received) == len(set(received)) == EVENTS, "each event once (Nats-Msg-Id dedupe)"
    key_of = dict(zip(ids, keys, strict=True))
    for key in set(keys):
        assert [i for i in received if key_of[i] == key] == [i for i, k in zip(ids, keys, strict=True) if k == key]
    assert all(isinstance(i, uuid.UUID) for i in received)
