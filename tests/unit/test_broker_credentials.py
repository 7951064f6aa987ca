"""The broker sinks' credentials (outbox_relay.sinks.credentials): a password or token in a URL or a file is
masked by ``redact`` as soon as the sink's check has read it, as written and percent-decoded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from outbox_relay.dsn import redact
from outbox_relay.errors import ConfigurationError
from outbox_relay.sinks.nats.connection import check_url as nats_url
from outbox_relay.sinks.nats.connection import read_secret
from outbox_relay.sinks.rabbitmq.connection import check_url as rabbitmq_url
from outbox_relay.sinks.rabbitmq.connection import read_password as rabbitmq_password
from outbox_relay.sinks.redis.connection import check_url as redis_url
from outbox_relay.sinks.redis.connection import read_password as redis_password


@pytest.mark.parametrize(("check", "template"), [
    (rabbitmq_url, "amqp://app:{}@rabbit.example:5672/vhost"),
    (redis_url, "redis://app:{}@cache.example:6379/0"),
    (nats_url, "nats://app:{}@nats.example:4222"),
    (nats_url, "nats://{}@nats.example:4222"),  # a token as the user info
])
def test_a_urls_secret_is_masked_as_written_and_decoded(check: Callable[[str], object], template: str) -> None:
    raw = f"{check.__module__.split('.')[2]}-Secret%2F{len(template)}"  # unique per case: nothing remembered yet
    decoded = raw.replace("%2F", "/")
    check(template.format(raw))
    shown = redact(f"failed: {template.format(raw)} ({decoded})")
    assert raw not in shown and decoded not in shown, shown


def test_the_user_name_beside_a_password_is_not_taken_for_a_secret() -> None:
    nats_url("nats://visible-user-name:Pw-Hidden-1@nats.example:4222")
    assert redact("visible-user-name") == "visible-user-name"
    assert redact("Pw-Hidden-1") == "***"


@pytest.mark.parametrize(("read", "what"), [
    (rabbitmq_password, "the RabbitMQ password file"),
    (redis_password, "the Redis password file"),
    (lambda path: read_secret(path, "token"), "the NATS token file"),
])
def test_a_secret_file(tmp_path: Path, read: Callable[[Path], str], what: str) -> None:
    path = tmp_path / "secret"
    path.write_text(f"File-Secret-{len(what)}\r\n")
    assert read(path) == f"File-Secret-{len(what)}"  # one trailing newline dropped
    assert redact(f"auth failed with File-Secret-{len(what)}") == "auth failed with ***"
    with pytest.raises(ConfigurationError, match=f"cannot read {what} .*missing': No such file"):
        read(tmp_path / "missing")


def test_an_empty_password_file_is_refused_an_empty_nats_file_is_not(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.write_text("\n")
    for read, what in ((rabbitmq_password, "RabbitMQ"), (redis_password, "Redis")):
        with pytest.raises(ConfigurationError, match=f"the {what} password file .* is empty"):
            read(path)
    assert read_secret(path, "password") == ""
