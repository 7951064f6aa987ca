"""The inbox's settings, message decoding and handler time limit, without servers."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from outbox_relay import timelimit
from outbox_relay.errors import ConfigurationError
from outbox_relay.inbox import HandlerTimeout, InboxMessage, load_inbox_settings, make_message
from outbox_relay.inbox.store import InboxStuck, TimeLimit

BASE = {"dsn": "postgresql://u@h/db", "bootstrap_servers": "127.0.0.1:9092", "topics": "a, b,a"}


def test_settings_split_topics_and_name_the_option_and_variable_of_a_bad_value() -> None:
    assert load_inbox_settings(**BASE).topics == ["a", "b"]
    with pytest.raises(ConfigurationError, match=r"consumer \(--consumer, OUTBOX_INBOX_CONSUMER\)"):
        load_inbox_settings(**BASE, consumer="no spaces")
    with pytest.raises(ConfigurationError, match=r"consumer \(--consumer, OUTBOX_INBOX_CONSUMER\)"):
        load_inbox_settings(**BASE, consumer="orders\n")  # a ConfigMap's trailing newline
    with pytest.raises(ConfigurationError, match=r"topics \(--topic, OUTBOX_INBOX_TOPICS\)"):
        load_inbox_settings(**{**BASE, "topics": "ok,bad/topic"})
    with pytest.raises(ConfigurationError, match="backoff_base_seconds must not exceed"):
        load_inbox_settings(**BASE, backoff_base_seconds=10, backoff_max_seconds=1)
    with pytest.raises(ConfigurationError, match=r"handler .*MODULE:ATTR"):
        load_inbox_settings(**BASE, handler="just_a_module")


def test_settings_never_echo_the_dsn(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError) as info:
        load_inbox_settings(**{**BASE, "dsn": "postgresql://u:hunter2@h/db", "batch_size": 0})
    assert "hunter2" not in str(info.value) and "batch_size" in str(info.value)


def test_the_message_id_is_ce_id_or_the_position() -> None:
    m = make_message({"x": 1}, ce_id="e-1", key="k1", topic="t", partition=2, offset=9)
    assert (m.id, m.type, m.partition_key, m.json()) == ("e-1", "test.event", "k1", {"x": 1})
    bare = InboxMessage(topic="t", partition=2, offset=9, key=None, value=None)
    assert bare.id == "kafka:t:2:9" and bare.json() is None


def test_a_ce_id_that_can_not_be_a_dedupe_key_says_why_and_falls_back_to_the_position() -> None:
    assert make_message({}, ce_id="e-1").id_problem is None
    for ce_id, why in [("a\x00b", "NUL"), ("x" * 1025, "1025 bytes long")]:
        m = make_message({}, ce_id=ce_id, topic="t", partition=0, offset=3)
        assert why in (m.id_problem or "") and m.id == "kafka:t:0:3"


class _Conn:
    """What TimeLimit touches of a connection when a handler overruns."""

    def __init__(self) -> None:
        self.closed = False

    def cancel_safe(self, timeout: float) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_a_handler_past_its_time_limit_is_abandoned_and_too_many_stop_the_consumer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The process's cap (shared with the relay's sinks): two more abandoned threads put it over.
    monkeypatch.setattr(timelimit, "MAX_ABANDONED", timelimit.abandoned_threads() + 1)
    limit = TimeLimit(0.05)
    release = threading.Event()
    seen: list[int] = []

    def handler(message: InboxMessage, conn: Any) -> None:
        seen.append(message.offset)
        if message.offset < 2:
            release.wait(5)

    limit.call(handler, make_message(offset=5), _Conn())  # type: ignore[arg-type]
    for offset in (0, 1):
        conn = _Conn()
        started = time.monotonic()
        with pytest.raises(HandlerTimeout):
            limit.call(handler, make_message(offset=offset), conn)  # type: ignore[arg-type]
        assert conn.closed and time.monotonic() - started < 2
    with pytest.raises(InboxStuck, match="handlers that never returned are left on threads of this process"):
        limit.call(handler, make_message(offset=3), _Conn())  # type: ignore[arg-type]
    release.set()
    assert seen == [5, 0, 1]


def test_what_a_handler_raises_reaches_the_caller() -> None:
    def handler(message: InboxMessage, conn: Any) -> None:
        raise KeyError("missing")

    limit = TimeLimit(5)
    with pytest.raises(KeyError, match="missing"):
        limit.call(handler, make_message(), _Conn())  # type: ignore[arg-type]
    limit.call(lambda m, c: None, make_message(), _Conn())  # type: ignore[arg-type]  # the thread goes on
    limit.close()


def test_the_retry_command_says_a_dead_letter_is_applied_late(capsys: pytest.CaptureFixture[str]) -> None:
    from outbox_relay.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["inbox", "dead-letters", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "late: after the later messages of its partition" in text and "message.late" in text


def test_dead_letters_shown_in_a_terminal_escape_what_a_producer_wrote(capsys: pytest.CaptureFixture[str]) -> None:
    from outbox_relay.inbox.cli import _output, _show

    hostile = "\x1b]0;pwned\x07\u202egnp.exe"
    _show({"id": 1, "value": hostile.encode(), "error": f"ValueError: {hostile}", "header_names": ["ce_type"],
           "header_values": [hostile.encode()]}, as_json=False)
    _output([{"id": 1, "error": f"ValueError: {hostile}\nsecond line"}], as_json=False, empty="none")
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out
    assert "\\x1b]0;pwned\\x07\\u202egnp.exe" in out and "second line" in out.splitlines()[-1]


def test_run_help_shows_each_default_and_every_variable_read(capsys: pytest.CaptureFixture[str]) -> None:
    """It showed ``(default: PydanticUndefined; ...)`` for the settings whose default is made by a factory."""
    from outbox_relay.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["inbox", "run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Undefined" not in text
    for expected in ("(default: none; OUTBOX_INBOX_KAFKA_CONFIG or OUTBOX_KAFKA_CONFIG)",
                     "(default: required; OUTBOX_INBOX_DSN or OUTBOX_DSN)",
                     "(default: required; OUTBOX_INBOX_BOOTSTRAP_SERVERS or OUTBOX_KAFKA_BOOTSTRAP_SERVERS)",
                     "(default: host-pid; OUTBOX_INBOX_MEMBER_ID)", "(default: 100; OUTBOX_INBOX_BATCH_SIZE)"):
        assert expected in text, expected


def test_the_inbox_reads_the_relays_variables_for_the_database_and_the_brokers(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Any) -> None:
    """The OUTBOX_DSN and OUTBOX_KAFKA_BOOTSTRAP_SERVERS that `outbox-relay dev` tells you to export serve
    the inbox too (it read only OUTBOX_INBOX_*); the inbox's own variable wins where both are set."""
    for name in ("OUTBOX_INBOX_DSN", "OUTBOX_INBOX_BOOTSTRAP_SERVERS", "OUTBOX_INBOX_KAFKA_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    monkeypatch.setenv("OUTBOX_DSN", "postgresql://u@relay-db/app")
    monkeypatch.setenv("OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "kafka:9092")
    monkeypatch.setenv("OUTBOX_KAFKA_CONFIG", f'{{"sasl.password": "@{secret}"}}')
    s = load_inbox_settings(topics="orders")
    assert (s.dsn.get_secret_value(), s.bootstrap_servers) == ("postgresql://u@relay-db/app", "kafka:9092")
    assert s.consumer_config()["sasl.password"] == "s3cret", "the relay's @PATH values too"
    monkeypatch.setenv("OUTBOX_INBOX_DSN", "postgresql://u@inbox-db/app")
    monkeypatch.setenv("OUTBOX_INBOX_BOOTSTRAP_SERVERS", "other:9092")
    s = load_inbox_settings(topics="orders")
    assert (s.dsn.get_secret_value(), s.bootstrap_servers) == ("postgresql://u@inbox-db/app", "other:9092")
    assert load_inbox_settings(topics="orders", dsn="postgresql://u@flag/app").dsn.get_secret_value() == \
        "postgresql://u@flag/app", "an option wins over both"
    monkeypatch.delenv("OUTBOX_INBOX_DSN")
    monkeypatch.delenv("OUTBOX_DSN")
    with pytest.raises(ConfigurationError, match="no database given: pass --dsn or set OUTBOX_INBOX_DSN or OUTBOX_DSN"):
        load_inbox_settings(topics="orders")


def test_the_operator_commands_read_the_relays_database_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from outbox_relay.cli import build_parser
    from outbox_relay.inbox.cli import _dsn_of

    monkeypatch.delenv("OUTBOX_INBOX_DSN", raising=False)
    monkeypatch.setenv("OUTBOX_DSN", "postgresql://u@relay-db/app")
    assert _dsn_of(build_parser().parse_args(["inbox", "status"])) == "postgresql://u@relay-db/app"


def test_counts_in_messages_agree_with_their_number() -> None:
    from outbox_relay.errors import counted

    assert (counted(1, "attempt"), counted(0, "attempt"), counted(3, "attempt")) == ("1 attempt", "0 attempts",
                                                                                    "3 attempts")
