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


# -- passwords that the simple patterns missed (spaces, tabs, bad percent-encoding) ---------------


@pytest.mark.parametrize(("dsn", "secret"), [
    ("postgresql://app:pa ss word@db:5432/shop", "pa ss word"),
    ("postgresql://app:pa\tss\tword@db:5432/shop", "pa\tss\tword"),
    ("postgresql://app:pa%zzssword@db/shop", "pa%zzssword"),
    ("host=db password='pa ss word' dbname=shop", "pa ss word"),
    ("host=db password='unterminated pa ss word", "pa ss word"),
])
def test_redacts_passwords_with_spaces_tabs_and_bad_escapes(dsn: str, secret: str) -> None:
    assert secret not in redact(dsn)
    assert "ss" not in redact(dsn).replace("password", ""), redact(dsn)


def test_a_url_without_user_info_is_left_alone() -> None:
    assert redact("https://idp.example/token and postgresql://db:5432/shop") == \
        "https://idp.example/token and postgresql://db:5432/shop"


def test_remembered_dsn_password_is_masked_anywhere_in_every_form() -> None:
    from urllib.parse import quote

    from outbox_relay.dsn import remember_dsn

    password = "Remembered pw/with?odd&chars"
    remember_dsn(f"postgresql://app:{quote(password, safe='')}@db/shop")
    for text in (f"error near {password!r}", f"token: {quote(password, safe='')}", f"x{quote(password)}y"):
        assert "Remembered" not in redact(text), redact(text)


def test_remembered_password_of_an_unparseable_dsn_is_masked() -> None:
    from outbox_relay.dsn import remember_dsn

    remember_dsn("postgresql://app:Unparse%zzable@db/shop")
    assert "Unparse" not in redact('invalid percent-encoded token: "Unparse%zzable"')


def test_short_values_are_not_masked_by_value() -> None:
    from outbox_relay.dsn import remember_secret

    remember_secret("abc")
    assert redact("abcdef") == "abcdef"


@pytest.mark.parametrize("dsn", [
    "postgresql://u:Secret%zz@db/x",
    "postgresql://u:Secret wi7h b1anks@db/x",
    "host=db password=Secret wi7h b1anks",
    "host=db password='Secret unterminated",
    "postgresql://u:Secret@[::1/x",
])
def test_check_dsn_refuses_an_unparseable_dsn_without_quoting_it(dsn: str) -> None:
    from outbox_relay.dsn import check_dsn
    from outbox_relay.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="not a valid PostgreSQL connection string") as caught:
        check_dsn(dsn)
    assert "Secret" not in str(caught.value) and "b1anks" not in str(caught.value), str(caught.value)


# Every property of librdkafka's CONFIGURATION.md whose value is a secret.
LIBRDKAFKA_SECRETS = [
    "sasl.password", "ssl.key.password", "ssl.key.pem", "ssl.keystore.password", "sasl.oauthbearer.config",
    "sasl.oauthbearer.client.secret", "sasl.oauthbearer.client.credentials.client.secret",
    "sasl.oauthbearer.extensions", "sasl.oauthbearer.assertion.private.key.pem",
    "sasl.oauthbearer.assertion.private.key.passphrase", "sasl.jaas.config",
]
NOT_SECRET = ["bootstrap.servers", "security.protocol", "sasl.username", "sasl.mechanism", "ssl.ca.location",
              "ssl.key.location", "ssl.certificate.pem", "sasl.oauthbearer.client.id",
              "sasl.oauthbearer.token.endpoint.url", "sasl.oauthbearer.assertion.private.key.file", "linger.ms"]


@pytest.mark.parametrize("option", LIBRDKAFKA_SECRETS)
def test_every_librdkafka_secret_property_is_masked(option: str) -> None:
    assert redact_kafka_config({option: "s3cret-value"}) == {option: "***"}


@pytest.mark.parametrize("option", NOT_SECRET)
def test_other_properties_stay_readable(option: str) -> None:
    assert redact_kafka_config({option: "visible"}) == {option: "visible"}


def test_kafka_url_keeps_its_host_but_not_its_password() -> None:
    safe = redact_kafka_config({"sasl.oauthbearer.token.endpoint.url": "https://relay:s3cret@idp.example/token"})
    assert safe == {"sasl.oauthbearer.token.endpoint.url": "https://relay:***@idp.example/token"}


def test_remembered_kafka_secrets_are_masked_in_any_text() -> None:
    from outbox_relay.dsn import remember_kafka_secrets

    remember_kafka_secrets({"sasl.oauthbearer.extensions": "org=Ext3nsionValue", "client.id": "plainclient"})
    assert redact("broker said: org=Ext3nsionValue rejected by plainclient") == \
        "broker said: *** rejected by plainclient"


# -- connection_problem: message shapes of libpq (integration tests use real failures) -----------


class _Fake(Exception):
    def __init__(self, text: str, sqlstate: str | None = None) -> None:
        super().__init__(text)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(("text", "expected"), [
    ('connection failed: connection to server at "10.0.0.1", port 5432 failed: FATAL:  sorry, too many clients '
     'already', 'too many connections: the server has no connection slot free (server "10.0.0.1", port 5432)'),
    ('connection failed: connection to server at "10.0.0.1", port 5432 failed: FATAL:  remaining connection slots '
     'are reserved for roles with the SUPERUSER attribute', "too many connections"),
    ('connection failed: connection to server on socket "/run/pg/.s.PGSQL.5432" failed: FATAL:  password '
     'authentication failed for user "relay"', 'authentication failed (socket "/run/pg/.s.PGSQL.5432")'),
    ('connection failed: connection to server at "db", port 5432 failed: FATAL:  database "shop" does not exist',
     'the database does not exist (server "db", port 5432): database "shop" does not exist'),
    ('connection failed: connection to server at "db", port 5432 failed: Connection refused\n\tIs the server '
     'running on that host and accepting TCP/IP connections?', 'the server is not reachable (server "db", port '
                                                               '5432): Connection refused'),
    ("failed to resolve host 'nowhere': [Errno -2] Name or service not known", "the server is not reachable"),
    ('connection failed: connection to server at "db", port 5432 failed: FATAL:  the database system is starting '
     'up', "the server is starting up or shutting down"),
])
def test_connection_problem_names_the_cause_in_one_line(text: str, expected: str) -> None:
    from outbox_relay.dsn import connection_problem

    problem = connection_problem(_Fake(text))
    assert expected in problem and "\n" not in problem, problem
