"""The Kafka producer's settings: the relay's defaults and the checks that refuse what would break the sink's
promises."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import ConfigurationError

PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    # No linger: the relay produces a whole batch, then waits for its acknowledgements, so messages
    # queue behind the first request anyway. Measured on the bench machine (1 relay, ~400 ev/s): 2 ms of
    # linger made a cycle 9.3 ms instead of 4.8 ms (produce -> acks 4.0 vs 1.2 ms), and drain rates were
    # the same within noise (bench/run.py --quick --cases drain, with --kafka-option linger.ms=0).
    "linger.ms": 0,
    "message.timeout.ms": 0,
    "partitioner": "murmur2_random",  # same partition for a key as the Java client
    "compression.type": "none",
    "queue.buffering.max.messages": 200_000,
}

def check_config(config: Mapping[str, Any]) -> None:
    """Refuse librdkafka settings that would break what the sink promises (ConfigurationError).

    - ``message.timeout.ms`` / ``delivery.timeout.ms`` other than 0: a message that times out
      during a broker outage would come back as a failure and burn one of the event's attempts
      per outage (and dead-letter it after ``--max-attempts`` outages), and a timeout is no
      substitute for stall detection either: a wedged producer is replaced after
      ``--kafka-stall-seconds``, its messages sent again without counting an attempt.
    - ``acks=0``: the broker acknowledges nothing, so no delivery report carries an offset and
      no event could ever count as delivered.
    - ``enable.idempotence`` other than true: without the idempotent producer, a request that
      librdkafka retries can land after a later request to the same partition (several are in
      flight), so a key's messages arrive reordered; replacing a producer and re-sending its
      unacknowledged messages in order (``_resend``) relies on it too.
    """
    for name in ("message.timeout.ms", "delivery.timeout.ms"):
        if name in config and str(config[name]).strip() != "0":
            raise ConfigurationError(
                f"Kafka option {name}={config[name]} is not supported: the relay waits for the broker without a "
                "message timeout, so that an outage costs no delivery attempts; a producer that stops getting "
                "delivery reports is replaced after --kafka-stall-seconds instead (leave the option out)")
    for name in ("acks", "request.required.acks"):
        if name in config and str(config[name]).strip() == "0":
            raise ConfigurationError(
                f"Kafka option {name}=0 is not supported: an event counts as delivered only once the broker "
                "acknowledged it with an offset, which acks=0 never does (leave the option out: acks=all)")
    value = config.get("enable.idempotence", True)
    if str(value).strip().lower() not in ("true", "1", "t"):  # what librdkafka reads as true
        raise ConfigurationError(
            f"Kafka option enable.idempotence={value} is not supported: without the idempotent producer a "
            "request librdkafka retries can land after a later one to the same partition, so a key's messages "
            "would arrive out of order (leave the option out: enable.idempotence=true)")
