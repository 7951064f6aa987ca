"""The real `outbox-relay run --sqs-url ...` against SQS (moto's server mode over HTTP, its own process):
the relay is killed (SIGKILL) mid-stream and another takes over, then the SQS endpoint is killed and
started again empty (moto keeps nothing: the queue is made again, as an operator would) while the relay
runs. Read back from the queue: every event is there, each key's first-seen order is its publish order,
nothing was dead-lettered. Duplicates may come only from the restart that lost SQS's deduplication
memory; the relay's crash adds none within SQS's 5-minute window.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from outbox_relay.sinks.sqs.readback import read_back
from outbox_relay.sqs_settings import SqsSettings
from tests.integration.relay_helpers import dead_letters, fetch_all, publish
from tests.servers import wait_until
from tests.sqs_server import DUMMY_CREDENTIALS, QUIET, MotoServer, Namespace, use_dummy_credentials

pytestmark = pytest.mark.slow

TOPIC = "orders"
FAST = ["--heartbeat-seconds", "0.5", "--worker-ttl-seconds", "2", "--housekeeping-seconds", "0.5",
        "--poll-seconds", "0.2", "--backoff-base-seconds", "0.05", "--backoff-max-seconds", "0.5"]


def command() -> list[str]:
    script = Path(sys.executable).with_name("outbox-relay")
    return [str(script)] if script.exists() else [sys.executable, "-m", "outbox_relay.cli"]


def start(dsn: str, tmp_path: Path, worker_id: str, url: str, prefix: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, **DUMMY_CREDENTIALS, "OUTBOX_DSN": dsn, "PYTHONUNBUFFERED": "1"}
    env.pop("AWS_PROFILE", None)
    with (tmp_path / f"{worker_id}.stderr").open("wb") as err:
        return subprocess.Popen(
            # --cursor-flush-seconds 0: delivered() reads the stored cursors, so they follow every batch (a busy
            # relay otherwise writes them once a second, and the kill below could land after the last batch).
            [*command(), "run", "--worker-id", worker_id, *FAST, "--no-kafka", "--batch-size", "100",
             "--cursor-flush-seconds", "0",
             "--sqs-url", url, "--sqs-queue-prefix", prefix, "--sqs-unavailable-seconds", "0.3",
             "--sqs-timeout-seconds", "2", "--sqs-connect-timeout-seconds", "1"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)


def delivered(dsn: str) -> int:
    """Events the sqs sink's stored cursors are past and that are not parked (held or waiting for a retry)."""
    past = fetch_all(dsn, "SELECT count(*) FROM outbox.events e JOIN outbox.cursors c ON c.sink = 'sqs' AND "
                          "c.bucket = e.bucket WHERE outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, "
                          "c.after_xid, c.after_seq)")[0][0]
    return int(past) - parked(dsn)


def parked(dsn: str) -> int:
    return int(fetch_all(dsn, "SELECT count(*) FROM outbox.parked WHERE sink = 'sqs'")[0][0])


def test_relay_killed_and_sqs_restarted_mid_stream_lose_nothing_and_reorder_nothing(
        dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_dummy_credentials(monkeypatch)
    moto = MotoServer(tmp_path / "moto.log").start()
    ns = Namespace(moto.url)
    ns.create(TOPIC)
    fields = SqsSettings(sqs_url=moto.url, sqs_queue_prefix=ns.prefix)
    got: list[tuple[uuid.UUID, str, str]] = []

    def read() -> set[uuid.UUID]:
        got.extend(read_back(fields, timeout_seconds=30, quiet_seconds=QUIET))
        return {i for i, _k, _q in got}

    keys = [f"order:{i % 20}" for i in range(1600)]
    ids = publish(dsn, [(k, "OrderPlaced", {"n": n}) for n, k in enumerate(keys)], topic=TOPIC)
    relays = [start(dsn, tmp_path, "sqs-a", moto.url, ns.prefix)]

    def logs() -> str:
        return "\n".join(p.read_text()[-1500:] for p in sorted(tmp_path.glob("*.stderr")))

    try:
        wait_until(lambda: delivered(dsn) >= 300, timeout=60, message="the first events delivered")
        relays[0].kill()  # SIGKILL: what it sent since its last checkpoint is sent again by the next relay
        relays[0].wait(10)
        assert delivered(dsn) < len(ids), "killed before the end"
        relays.append(start(dsn, tmp_path, "sqs-b", moto.url, ns.prefix))
        wait_until(lambda: delivered(dsn) >= 800, timeout=60, message="delivery resumed")

        # SQS away: what it holds is read first, while the relay is stopped (nothing it counts delivered
        # can then be missed by the read), since the restart forgets it.
        relays[1].send_signal(signal.SIGSTOP)
        time.sleep(0.3)  # a request moto is still writing
        read()
        assert delivered(dsn) < len(ids), "SQS goes away mid-stream"
        moto.kill()
        relays[1].send_signal(signal.SIGCONT)
        wait_until(lambda: parked(dsn) > 0, timeout=30, message="the relay holds its events while SQS is away")
        assert relays[1].poll() is None, logs()
        moto.start()
        ns.create(TOPIC)  # SQS (moto) came back empty: the queue is made again
        wait_until(lambda: delivered(dsn) == len(ids), timeout=90, message="every event delivered")
        relays[1].send_signal(signal.SIGTERM)
        assert relays[1].wait(30) == 0, logs()
        missing = set(ids) - read()
        assert not missing, (f"{len(missing)} events not in SQS, at positions "
                             f"{sorted(ids.index(i) for i in missing)[:50]}; {logs()}")
    finally:
        for p in relays:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(10)
        ns.close()
        moto.kill()
    assert dead_letters(dsn, "sqs") == {}
    first_seen: dict[str, list[uuid.UUID]] = defaultdict(list)
    seen: set[uuid.UUID] = set()
    for event_id, key, queue in got:
        assert queue == ns.name(TOPIC)
        if event_id not in seen:
            seen.add(event_id)
            first_seen[key].append(event_id)
    want: dict[str, list[uuid.UUID]] = defaultdict(list)
    for key, event_id in zip(keys, ids, strict=True):
        want[key].append(event_id)
    assert dict(first_seen) == dict(want), "per key, the first-seen order is the publish order"
