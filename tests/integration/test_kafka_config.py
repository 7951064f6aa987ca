"""librdkafka settings the Kafka sink refuses, because they would break what it promises.

A message timeout (``message.timeout.ms`` or its alias ``delivery.timeout.ms``) turns every broker
outage longer than the timeout into failed deliveries: one attempt burned per event and outage,
dead letters after ``--max-attempts`` of them, and stall detection replaced by something blunter.
``acks=0`` gives no acknowledgement, so nothing could ever count as delivered. Without
``enable.idempotence`` librdkafka's retries can reorder a key's messages. The relay says so at
start, before it touches the database, instead of misbehaving during the next outage. Options
librdkafka itself refuses (unknown, or contradicting idempotence) are the same kind of error.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from outbox_relay.errors import ConfigurationError
from outbox_relay.sinks.kafka import KafkaSink

NOWHERE = "127.0.0.1:1"  # no broker is needed: the check comes first


@pytest.mark.parametrize("option, value, named", [
    ("message.timeout.ms", "30000", "message.timeout.ms=30000"),
    ("delivery.timeout.ms", 120000, "delivery.timeout.ms=120000"),
    ("acks", "0", "acks=0"),  # with enable.idempotence=false librdkafka would take it
    ("request.required.acks", 0, "request.required.acks=0"),
    ("enable.idempotence", "false", "enable.idempotence=false"),  # librdkafka would take it
    ("enable.idempotence", False, "enable.idempotence=False"),
    ("enable.idempotence", "0", "enable.idempotence=0"),
])
def test_settings_that_defeat_the_sink_are_refused_by_name(option: str, value: object, named: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        KafkaSink("kafka", {"bootstrap.servers": NOWHERE, option: value}, "t", "urn:test")
    assert named in str(refused.value)
    if "timeout" in option:
        assert "--kafka-stall-seconds" in str(refused.value), "the message says what to use instead"
    if option == "enable.idempotence":
        assert "out of order" in str(refused.value), "the message says why"


@pytest.mark.parametrize("option, value, named", [
    ("no.such.option", "1", '"no.such.option"'),
    ("acks", "1", "`acks` must be set to `all` when `enable.idempotence` is true"),
])
def test_settings_librdkafka_refuses_are_a_configuration_error(option: str, value: str, named: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        KafkaSink("kafka", {"bootstrap.servers": NOWHERE, option: value}, "t", "urn:test")
    assert named in str(refused.value)


@pytest.mark.parametrize("option, value", [("message.timeout.ms", "0"), ("delivery.timeout.ms", 0), ("acks", "all"),
                                           ("acks", "-1"), ("linger.ms", "5"), ("enable.idempotence", "true"),
                                           ("enable.idempotence", True)])
def test_settings_that_keep_the_promise_are_accepted(option: str, value: str) -> None:
    KafkaSink("kafka", {"bootstrap.servers": NOWHERE, option: value}, "t", "urn:test").close()


@pytest.mark.parametrize("option, message", [
    ("message.timeout.ms=5000", "Kafka option message.timeout.ms=5000 is not supported"),
    ("enable.idempotence=false", "Kafka option enable.idempotence=false is not supported"),
    ("no.such.option=1", 'Kafka options refused by librdkafka: No such configuration property: "no.such.option"'),
])
def test_the_relay_refuses_them_at_start(option: str, message: str) -> None:
    """`outbox-relay run --kafka-option ...` exits with the reason, not a traceback; the database it
    names does not exist, so a relay that went on would wait for it instead."""
    env = {**os.environ, "OUTBOX_DSN": "postgresql://nobody@127.0.0.1:1/nothing"}
    result = subprocess.run(
        [sys.executable, "-m", "outbox_relay.cli", "run", "--kafka-bootstrap-servers", NOWHERE,
         "--kafka-option", option],
        env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"outbox-relay: error: {message}" in result.stderr
    assert "Traceback" not in result.stderr
