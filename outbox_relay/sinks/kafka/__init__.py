"""The Kafka sink (confluent-kafka): an event counts as delivered once the broker acknowledged it."""

from .sink import (
           LIBRDKAFKA_LOG,
           PRODUCER_DEFAULTS,
           RESERVED_HEADERS,
           RESERVED_PREFIX,
           KafkaSink,
           TopicCondition,
           check_config,
           is_reserved_header,
           sequence,
)

__all__ = ["LIBRDKAFKA_LOG", "PRODUCER_DEFAULTS", "RESERVED_HEADERS", "RESERVED_PREFIX", "KafkaSink", "TopicCondition",
           "check_config", "is_reserved_header", "sequence"]
