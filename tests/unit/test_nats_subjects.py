"""The NATS sink's subjects (outbox_relay/sinks/nats/subjects.py): one token per key, one-to-one, reversible;
prefixes and topics checked; messages too long or with headers NATS can not carry refused (no server needed)."""

from __future__ import annotations

import urllib.parse
import uuid
from datetime import UTC, datetime
from types import MappingProxyType

import pytest

from outbox_relay.errors import ConfigurationError
from outbox_relay.sinks import GiveUp, SinkEvent
from outbox_relay.sinks.nats.message import message
from outbox_relay.sinks.nats.subjects import check_prefix, subject, subject_token

KEYS = ["order:9182", "a.b", "a*b", "a>b", "a b", "tab\tkey", "100%", "%2E", "ü", "日本", "$SYS", "x" * 1024, "😀",
        "-_~:=@+,", ""]


@pytest.mark.parametrize("key", KEYS)
def test_a_key_is_one_safe_token_and_comes_back_with_unquote(key: str) -> None:
    token = subject_token(key)
    assert token.isascii() and not set(token) & set(".*> \t\r\n")
    assert urllib.parse.unquote(token) == key


def test_the_escaping_is_one_to_one() -> None:
    tokens = [subject_token(k) for k in KEYS]
    assert len(set(tokens)) == len(tokens)
    assert subject_token("a.b") == "a%2Eb" and subject_token("a%2Eb") == "a%252Eb"


@pytest.mark.parametrize("prefix", ["", "a.", ".a", "a..b", "a.*", "a.>", "$JS", "a b", "x" * 256])
def test_bad_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(ConfigurationError, match="subject prefix"):
        check_prefix(prefix)


def _event(key: str = "k", topic: str | None = "orders", headers: dict[str, str] | None = None) -> SinkEvent:
    return SinkEvent(uuid.uuid4(), topic, key, "T", "{}", MappingProxyType(headers or {}), datetime.now(UTC), 1, 1)


def test_a_message_goes_to_prefix_topic_key() -> None:
    made = message(_event("a.b", "orders.eu"), sink="s", prefix="app", default_topic=None, source="src")
    assert not isinstance(made, GiveUp)
    assert made.subject == subject("app", "orders.eu", "a.b") == "app.orders.eu.a%2Eb"
    assert made.size > len(made.payload)


@pytest.mark.parametrize(("event", "words"), [
    (_event(topic=None), "no topic"),
    (_event(topic="a..b"), "empty token"),
    (_event(topic="a b"), "whitespace"),  # the sink writes the protocol line itself (acks.py)
    (_event(topic="a\r\nPUB x 1"), "control character"),
    (_event(key="日" * 500), "bytes once escaped"),  # past the 1,024-byte key limit: rows from before it
    (_event(headers={"bad name": "v"}), "not a valid NATS header name"),
    (_event(headers={"x-a": "line\r\nbreak"}), "line break"),
])
def test_faults_of_the_event_are_given_up_with_the_reason(event: SinkEvent, words: str) -> None:
    made = message(event, sink="s", prefix="app", default_topic=None, source="src")
    assert isinstance(made, GiveUp) and words in made.reason, made
