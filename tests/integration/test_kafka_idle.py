"""An idle relay still hears from librdkafka.

confluent-kafka hands librdkafka's log lines and error callbacks over only inside ``poll()``; a relay
with nothing to deliver calls no ``deliver`` and so would poll only at its next batch. The runner
gives its sink an idle call while it waits (``sink.wait_idle``), and the Kafka sink polls there.
Real PostgreSQL; the broker address is a closed port on this machine.
"""

from __future__ import annotations

import logging
from typing import Any

from outbox_relay.sinks.kafka import KafkaSink
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import fetch_all, make_settings
from tests.servers import free_port, wait_until


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_an_idle_relay_logs_librdkafka_s_connection_error_without_any_event(dsn: str) -> None:
    port = free_port()  # closed: nothing listens there
    records = _Records()
    logger = logging.getLogger("outbox_relay.librdkafka")
    logger.addHandler(records)
    sink = KafkaSink("kafka", {"bootstrap.servers": f"127.0.0.1:{port}"}, "t", "urn:test")
    # A long idle poll: the runner reads once, then waits; nothing else would call the producer.
    worker = Worker(make_settings(dsn, "idle", poll_seconds=60.0, listen_poll_seconds=60.0), sinks=[sink])
    try:
        assert worker.start()

        def refused() -> list[Any]:
            return [m for m in records.messages if f"127.0.0.1:{port}" in m]

        lines = wait_until(refused, 20, 0.1, "librdkafka's connection error on logger outbox_relay.librdkafka")
        assert any("Connect to" in m or "Connection refused" in m for m in lines), lines
    finally:
        worker.drain()
        worker.wait()
        logger.removeHandler(records)
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.events") == [(0,)], "the test published nothing"
