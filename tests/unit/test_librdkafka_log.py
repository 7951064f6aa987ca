"""librdkafka's own log lines reach the relay's logging (logger ``outbox_relay.librdkafka``), so that
``--log-json`` and the formatter's redaction cover them, instead of raw ``%3|...|FAIL|`` lines on stderr.

No server: the broker address is a closed port on this machine, whose connection failure librdkafka
logs while a batch waits for it.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import uuid
from datetime import UTC, datetime

import pytest

from outbox_relay.cli.logs import _JsonFormatter
from outbox_relay.dsn import remember_kafka_secrets
from outbox_relay.sinks.engine import Aborted, CommitAtEnd, Outcomes
from outbox_relay.sinks.kafka import KafkaSink
from outbox_relay.store import StoredEvent


class _Lines(logging.Handler):
    """Formats what reaches it as the relay's --log-json handler would, and says when it got a line."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(_JsonFormatter())
        self.lines: list[str] = []
        self.arrived = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))
        self.arrived.set()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_connection_failure_is_logged_through_the_relays_logger() -> None:
    port = closed_port()
    secret = "s3cret-in-a-log-line"
    remember_kafka_secrets({"sasl.password": secret})
    lines = _Lines()
    logger = logging.getLogger("outbox_relay.librdkafka")
    logger.addHandler(lines)
    # A client id is logged with every line: a secret that made it into one is redacted like any other.
    sink = KafkaSink("kafka", {"bootstrap.servers": f"127.0.0.1:{port}", "client.id": secret}, "t", "urn:test")
    event = StoredEvent(bucket=1, xid=1, seq=1, id=uuid.uuid4(), key="k", topic="t", type="T", payload_text="{}",
                        headers_text="{}", time=datetime.now(UTC))
    abort = threading.Event()

    def commit(outcomes: Outcomes, tx: object) -> set[int]:
        raise AssertionError("nothing can be delivered: the broker is not there")

    # The batch waits for the broker (no message timeout) until a line arrived, or 20 s passed.
    stop = threading.Thread(target=lambda: (lines.arrived.wait(20), abort.set()), daemon=True)
    stop.start()
    try:
        with pytest.raises(Aborted):
            sink.deliver([event], {1: 1}, CommitAtEnd.of(commit), abort)  # type: ignore[arg-type]
    finally:
        abort.set()
        sink.close()
        logger.removeHandler(lines)
    assert lines.lines, "no librdkafka line reached logger outbox_relay.librdkafka"
    entries = [json.loads(line) for line in lines.lines]
    assert all(e["logger"] == "outbox_relay.librdkafka" for e in entries)
    failed = [e for e in entries if f"127.0.0.1:{port}" in e["message"]]
    assert failed, entries
    assert failed[0]["level"] == "error"
    assert "Connection refused" in failed[0]["message"] or "Connect to" in failed[0]["message"]
    assert not any(secret in line for line in lines.lines)
