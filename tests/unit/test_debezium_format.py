"""The Debezium format's JSON strings are Kafka Connect's JsonConverter's (Jackson's escapes), and its options are
checked when the settings are read."""

from __future__ import annotations

import pytest

from outbox_relay.errors import ConfigurationError
from outbox_relay.settings import load_settings
from outbox_relay.sinks.kafka.debezium import json_string


def test_json_strings_escape_as_jackson_does() -> None:
    assert json_string('a"b\\c') == b'"a\\"b\\\\c"'
    assert json_string("\b\t\n\f\r") == b'"\\b\\t\\n\\f\\r"'
    assert json_string("\x00\x01\x1f") == b'"\\u0000\\u0001\\u001F"', "upper-case hex"
    assert json_string("\x7f / \u00e9 \u2028 \U0001f600") == "\"\x7f / \u00e9 \u2028 \U0001f600\"".encode(), \
        "DEL, slash and non-ASCII as they are (UTF-8)"


def test_a_topic_replacement_that_can_not_make_a_topic_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"kafka_debezium_topic .*routedByValue"):
        load_settings(dsn="postgresql:///x", kafka_debezium_topic="events/${routedByValue}")
    with pytest.raises(ConfigurationError, match="kafka_format"):
        load_settings(dsn="postgresql:///x", kafka_format="avro")
    assert load_settings(dsn="postgresql:///x", kafka_debezium_topic="${routedByValue}").kafka_format == "cloudevents"
