"""A real `outbox-relay run` whose broker is not there (issue 18 item 1): /readyz answers 503 naming
the brokers, and the log has one connection failure line for the outage (then one summary per 30 s),
not librdkafka's several a second; the relay names its database once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.integration.relay_helpers import publish
from tests.servers import free_port, wait_until


def readyz(port: int) -> tuple[int, dict[str, Any]] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except OSError:
        return None


def test_an_absent_broker_is_one_line_and_readiness_503(dsn: str, tmp_path: Path) -> None:
    with socket.socket() as s:  # nothing listens here
        s.bind(("127.0.0.1", 0))
        broker = f"127.0.0.1:{s.getsockname()[1]}"
    publish(dsn, [(f"k{i}", "t", {"i": i}) for i in range(20)])
    port = free_port()
    log = tmp_path / "relay.log"
    with log.open("wb") as out:
        relay = subprocess.Popen(
            [sys.executable, "-m", "outbox_relay.cli", "--log-json", "run", "--worker-id", "lonely",
             "--kafka-bootstrap-servers", broker, "--default-topic", "t", "--metrics-port", str(port),
             "--metrics-host", "127.0.0.1", "--drain-seconds", "1", "--heartbeat-seconds", "0.5"],
            env={**os.environ, "OUTBOX_DSN": dsn}, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        def not_ready() -> dict[str, Any] | None:
            answer = readyz(port)
            return answer[1] if answer and answer[0] == 503 and any(
                "Kafka brokers do not answer" in p for p in answer[1]["problems"]) else None

        wait_until(not_ready, 60, 0.2, "/readyz to say the brokers do not answer")

        def failures() -> list[dict[str, Any]]:
            lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
            return [e for e in lines if e["logger"] == "outbox_relay.librdkafka" and broker in e["message"]]

        wait_until(failures, 30, 0.2, "the first connection failure in the log")
        # Each readiness probe asks the brokers again (more connection attempts, more librdkafka lines);
        # each takes the probe's 2 s broker timeout, so a few make the point.
        for _ in range(3):
            wait_until(not_ready, 30, 0.2, "/readyz to stay 503")
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(60)
    entries = failures()
    raw = [e for e in entries if not e["message"].startswith(f"broker {broker} unreachable for ")]
    assert len(raw) == 1 and "Connect to" in raw[0]["message"], raw  # the rest are summaries, 30 s apart
    using = [json.loads(line)["message"] for line in log.read_text().splitlines()
             if line.startswith("{") and "using database" in line]
    assert len(using) == 1 and using[0].startswith("using database "), using
