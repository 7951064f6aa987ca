"""Acceptance: ``outbox-relay run --redis-url ...`` as a process, with a private ``redis-server``
(append-only file, fsync always) while a producer publishes: the relay is killed with SIGKILL mid-stream
and started again, then Redis is killed with SIGKILL and started again. At the end the streams hold
every event and each key's de-duplicated sequence is the published one (duplicates only where a crash
explains them)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from outbox_relay.redis_settings import RedisFields
from outbox_relay.sinks.redis.readback import read_back
from tests.integration.relay_helpers import publish
from tests.redis_server import PrivateRedis, private_redis
from tests.servers import wait_until

pytestmark = pytest.mark.slow

KEYS = 20
TOTAL = 3000
CHUNK = 50  # events per producer transaction
FAST = ["--no-kafka", "--heartbeat-seconds", "0.5", "--worker-ttl-seconds", "2", "--housekeeping-seconds", "0.5",
        "--poll-seconds", "0.2", "--batch-size", "100", "--backoff-base-seconds", "0.1", "--backoff-max-seconds",
        "0.5", "--redis-stream-prefix", "acc:", "--redis-timeout-seconds", "1"]


def command() -> list[str]:
    script = Path(sys.executable).with_name("outbox-relay")
    return [str(script)] if script.exists() else [sys.executable, "-m", "outbox_relay.cli"]


def start(dsn: str, server: PrivateRedis, tmp_path: Path, worker: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OUTBOX_DSN": dsn, "OUTBOX_REDIS_URL": server.url, "PYTHONUNBUFFERED": "1"}
    with (tmp_path / f"{worker}.stderr").open("wb") as err:
        return subprocess.Popen([*command(), "run", "--worker-id", worker, *FAST], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err)


def test_relay_and_redis_killed_mid_stream_lose_nothing_and_reorder_nothing(dsn: str, tmp_path: Path) -> None:
    keys = [f"order:{i % KEYS}" for i in range(TOTAL)]
    published: list[uuid.UUID] = []
    done = threading.Event()

    def produce() -> None:
        try:
            for at in range(0, TOTAL, CHUNK):
                published.extend(publish(dsn, [(k, "OrderPlaced", {"n": at + n})
                                               for n, k in enumerate(keys[at:at + CHUNK])], topic="orders"))
                time.sleep(0.02)
        finally:
            done.set()

    with private_redis(tmp_path / "redis") as server:
        fields = RedisFields(redis_url=server.url, redis_stream_prefix="acc:")

        def distinct() -> int:
            try:
                return len({i for i, _k, _s in read_back(fields)})
            except Exception:  # Redis is being restarted
                return 0

        producer = threading.Thread(target=produce)
        producer.start()
        relay = start(dsn, server, tmp_path, "redis-1")
        try:
            wait_until(lambda: distinct() >= 300, timeout=30, message="the first entries")
            relay.kill()  # SIGKILL: entries written, batches not checkpointed
            relay.wait(10)
            assert distinct() < TOTAL, "killed before the end"
            relay = start(dsn, server, tmp_path, "redis-2")
            reached = wait_until(lambda: (n := distinct()) >= 1200 and n, timeout=30, message="more entries")
            server.kill()  # SIGKILL: what was acknowledged is in the append-only file
            assert reached < TOTAL or not done.is_set(), "Redis killed mid-stream"
            time.sleep(0.5)  # the relay meets a server that is away (connection refused), not only a restart
            server.start()
            producer.join(60)
            assert done.is_set()
            wait_until(lambda: distinct() == TOTAL, timeout=60, message="every event in Redis")
        finally:
            if relay.poll() is None:
                relay.kill()
                relay.wait(10)
            producer.join(60)
        entries = read_back(fields)
    assert "unavailable" in (tmp_path / "redis-2.stderr").read_text(), "the relay saw Redis away and held"
    assert len(published) == TOTAL
    assert {i for i, _k, _s in entries} == set(published), "nothing lost, nothing that was never published"
    by_key: dict[str, list[uuid.UUID]] = {}
    seen: set[uuid.UUID] = set()
    for event_id, key, _stream in entries:
        if event_id not in seen:
            seen.add(event_id)
            by_key.setdefault(key, []).append(event_id)
    for key in set(keys):
        assert by_key[key] == [i for i, k in zip(published, keys, strict=True) if k == key], key
