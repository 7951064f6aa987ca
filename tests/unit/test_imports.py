"""A producer's ``import outbox_relay`` stays light: no relay engine, no confluent-kafka, no pool."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_package_loads_neither_the_engine_nor_kafka() -> None:
    code = ("import sys, outbox_relay; from outbox_relay import Outbox, wait_for; "
            "print(sorted(m for m in ('confluent_kafka', 'psycopg_pool', 'outbox_relay.worker', "
            "'outbox_relay.kafka_sink', 'projections') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_engine_is_there_when_asked_for() -> None:
    import outbox_relay
    from outbox_relay.worker import Worker

    assert outbox_relay.Worker is Worker
