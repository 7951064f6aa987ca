"""The Kafka sink (confluent-kafka): an event counts as delivered once the broker acknowledged it.

``sink.py`` (``KafkaSink``: the producer, its replacements, the batch's wait), ``flight.py`` (what one
producer instance was told), ``topics.py`` (held topics), ``message.py`` (an event as a message),
``debezium.py`` (one as Debezium's outbox event router emits it), ``config.py`` (producer settings and
their checks), ``broker_errors.py`` (what an error means).
"""

from .config import PRODUCER_DEFAULTS, check_config
from .debezium import DebeziumFormat
from .message import is_reserved_header, sequence
from .sink import LIBRDKAFKA_LOG, KafkaSink
from .topics import TopicCondition

__all__ = ["LIBRDKAFKA_LOG", "PRODUCER_DEFAULTS", "DebeziumFormat", "KafkaSink", "TopicCondition", "check_config",
           "is_reserved_header", "sequence"]
