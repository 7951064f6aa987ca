"""What the broker's and librdkafka's errors mean to the Kafka sink: the event's fault, the topic's, or the
producer session's."""

from __future__ import annotations

from confluent_kafka import KafkaError

from ..engine import Failure

# Errors no retry can fix: dead-letter at once with the reason. TOPIC_EXCEPTION is a topic name the
# broker refuses outright, which no operator action on the cluster changes.
NON_RETRIABLE = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_MSG,
    KafkaError.INVALID_RECORD,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.TOPIC_EXCEPTION,
    KafkaError._INVALID_ARG,
}

# Errors that say the topic can not be written by this producer now, whichever event it is: it does
# not exist (yet: auto-creation is off and it is created late) or an ACL denies it. An operator fixes
# them on the cluster; the events wait meanwhile (held), no attempt counted.
TOPIC_CONDITIONS = {
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
}

# Errors of the producer's idempotence session, not of the message: the broker forgot or
# refused the producer id or its sequence, or librdkafka purged the message because the
# instance turned fatal. A new producer fixes them, so they are not a delivery attempt.
SESSION_ERRORS = {
    KafkaError.UNKNOWN_PRODUCER_ID,
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
    KafkaError.DUPLICATE_SEQUENCE_NUMBER,
    KafkaError.INVALID_PRODUCER_EPOCH,
    KafkaError.INVALID_PRODUCER_ID_MAPPING,
    KafkaError.PRODUCER_FENCED,
    KafkaError._FATAL,
    KafkaError._GAPLESS_GUARANTEE,
    KafkaError._PURGE_QUEUE,
    KafkaError._PURGE_INFLIGHT,
}


def describe(err: KafkaError) -> str:
    return f"{err.name()}: {err.str()}"


def failure_of(err: KafkaError) -> Failure:
    """A delivery failure for ``err``: retried, unless no retry can fix it (``NON_RETRIABLE``)."""
    return Failure(f"kafka: {describe(err)}", retriable=err.code() not in NON_RETRIABLE)
