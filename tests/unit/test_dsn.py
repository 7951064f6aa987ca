"""Passwords never reach logs or error messages."""

from __future__ import annotations

import pytest

from outbox_relay.dsn import redact, redact_kafka_config


@pytest.mark.parametrize(("dsn", "expected"), [
    ("postgresql://app:s3cret@db.example:5432/shop", "postgresql://app:***@db.example:5432/shop"),
    ("postgres://app:pa:ss@db/shop?sslmode=require", "postgres://app:***@db/shop?sslmode=require"),
    ("postgresql+psycopg://app:s3cret@db/shop", "postgresql+psycopg://app:***@db/shop"),
    ("postgresql://:s3cret@db/shop", "postgresql://:***@db/shop"),
    ("host=db user=app password=s3cret dbname=shop", "host=db user=app password=*** dbname=shop"),
    ("host=db PASSWORD = s3cret dbname=shop", "host=db PASSWORD = *** dbname=shop"),
    ("host=db password='s3 cr\\'et' dbname=shop", "host=db password=*** dbname=shop"),
    ("postgresql://db/shop?password=s3cret", "postgresql://db/shop?password=***"),
])
def test_redacts_passwords(dsn: str, expected: str) -> None:
    assert redact(dsn) == expected
    assert "s3" not in redact(dsn) and "cr" not in redact(dsn)


@pytest.mark.parametrize("dsn", [
    "postgresql://app@db:5432/shop",
    "postgresql:///postgres?host=/tmp/sock",
    "host=db user=app dbname=shop",
])
def test_leaves_dsns_without_password_alone(dsn: str) -> None:
    assert redact(dsn) == dsn


def test_redacts_inside_a_message() -> None:
    message = 'connection to "postgresql://app:s3cret@db/shop" failed: password=hunter2 rejected'
    assert redact(message) == 'connection to "postgresql://app:***@db/shop" failed: password=*** rejected'


def test_kafka_config_secrets() -> None:
    config = {
        "bootstrap.servers": "k1:9092",
        "security.protocol": "SASL_SSL",
        "sasl.username": "relay",
        "sasl.password": "s3cret",
        "ssl.key.password": "s3cret",
        "sasl.oauthbearer.client.secret": "s3cret",
    }
    safe = redact_kafka_config(config)
    assert "s3cret" not in repr(safe)
    assert safe["bootstrap.servers"] == "k1:9092" and safe["sasl.username"] == "relay"
    assert set(safe) == set(config)
    assert config["sasl.password"] == "s3cret", "the caller's config is not modified"


@pytest.mark.parametrize("option", ["ssl.keystore.password", "ssl.key.pem", "sasl.oauthbearer.config"])
def test_kafka_config_other_secrets(option: str) -> None:
    assert "s3cret" not in repr(redact_kafka_config({option: "s3cret"}))
