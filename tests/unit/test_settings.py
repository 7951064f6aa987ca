"""RelaySettings: every number bounded and finite, names checked, errors that name the option and
never echo the value given, Kafka option values from files."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest

from outbox_relay.errors import ConfigurationError
from outbox_relay.settings import RelaySettings, bounds, load_settings

SECRET = "s3cr3t-V4lue"


@pytest.fixture(autouse=True)
def _no_outbox_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OUTBOX_DSN", "postgresql://relay@db.invalid/app")  # required; these tests never connect


@pytest.mark.parametrize(("field", "value"), [
    ("lease_seconds", "inf"),
    ("lease_seconds", "nan"),
    ("poll_seconds", "1e12"),  # threading.Event.wait(1e12) raises OverflowError in the sink thread
    ("poll_seconds", "0"),
    ("heartbeat_seconds", "-1"),
    ("backoff_max_seconds", "1e300"),
    ("retention_seconds", "-inf"),
    ("drain_seconds", "0"),
    ("batch_size", "0"),
    ("max_attempts", "1000000000"),
    ("retention_batch", "-5"),
    # The watcher sleeps with pg_sleep, which rounds up to whole milliseconds: 0.2 would silently be 1.
    ("watch_interval_ms", "0.2"),
    ("watch_interval_ms", "1.5"),
])
def test_numbers_out_of_bounds_are_refused_by_name(field: str, value: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_settings(**{field: value})
    message = str(caught.value)
    assert f"--{field.replace('_', '-')}" in message and f"OUTBOX_{field.upper()}" in message, message


def test_the_commit_watcher_interval_is_whole_milliseconds() -> None:
    assert load_settings(watch_interval_ms="2").watch_interval_ms == 2


def test_every_number_has_finite_bounds_that_threads_can_wait_on() -> None:
    for name, field in RelaySettings.model_fields.items():
        if field.annotation in (int, float):
            text = bounds(field)
            assert text is not None, f"{name} has no upper bound"
            high = float(text.split("-")[-1])
            assert math.isfinite(high) and high * 1.2 < threading.TIMEOUT_MAX, name


def test_bounds_are_named_in_the_help_text() -> None:
    from outbox_relay.cli import build_parser

    run = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    assert "(0.01-3600)" in run.format_help().replace("\n", " ").replace("  ", " ")


@pytest.mark.parametrize("name", ["Bad Name", "UPPER", "", "-starts-with-dash", "x" * 64])
def test_kafka_sink_name_follows_the_sinks_table_rule(name: str) -> None:
    with pytest.raises(ConfigurationError, match="--kafka-sink"):
        load_settings(kafka_sink=name)


def test_default_topic_must_be_a_kafka_topic_name() -> None:
    with pytest.raises(ConfigurationError, match="--default-topic"):
        load_settings(default_topic="orders and more")
    assert load_settings(default_topic="orders.v2_x-y").default_topic == "orders.v2_x-y"


def test_backoff_base_above_its_cap_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="backoff_base_seconds must not exceed backoff_max_seconds"):
        load_settings(backoff_base_seconds=10, backoff_max_seconds=1)


@pytest.mark.parametrize("kwargs", [
    {"kafka_config": {"sasl.password": 12345678}},  # not a string: pydantic would echo input_value
    {"dsn": f"postgresql://u:{SECRET}%zz@db/app"},  # libpq would quote the token
    {"dsn": f"postgresql://u:{SECRET} x@db/app"},
    {"dsn": f"host=db password={SECRET} x"},
    {"worker_id": SECRET * 30},
])
def test_errors_never_echo_the_value(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_settings(**kwargs)
    message = str(caught.value)
    assert SECRET not in message and "12345678" not in message and "input_value" not in message, message


def test_secret_in_the_kafka_config_environment_is_not_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_KAFKA_CONFIG", f'{{"sasl.password": 1234567890, "x": "{SECRET}"}}')
    with pytest.raises(ConfigurationError) as caught:
        load_settings()
    assert "1234567890" not in str(caught.value) and "OUTBOX_KAFKA_CONFIG" in str(caught.value)


def test_kafka_option_value_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "kafka-password"
    secret.write_text(SECRET + "\n")
    settings = load_settings(kafka_config={"sasl.password": f"@{secret}", "client.id": "@@literal"})
    assert settings.kafka_config == {"sasl.password": SECRET, "client.id": "@literal"}


def test_kafka_option_file_that_can_not_be_read_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"cannot read the value of Kafka option sasl.password from .*missing"):
        load_settings(kafka_config={"sasl.password": f"@{tmp_path / 'missing'}"})


def test_kafka_config_file(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text(SECRET)
    config = tmp_path / "client.properties"
    config.write_text(f"# producer\nsecurity.protocol = SASL_SSL\n\nsasl.password=@{secret}\nlinger.ms=5\n")
    settings = load_settings(kafka_config_file=str(config), kafka_config={"linger.ms": "9"})
    assert settings.kafka_config == {"security.protocol": "SASL_SSL", "sasl.password": SECRET, "linger.ms": "9"}


def test_kafka_config_file_with_a_bad_line_names_the_line_not_its_content(tmp_path: Path) -> None:
    config = tmp_path / "client.properties"
    config.write_text(f"security.protocol=SSL\n{SECRET}\n")
    with pytest.raises(ConfigurationError) as caught:
        load_settings(kafka_config_file=str(config))
    assert "line 2 is not KEY=VALUE" in str(caught.value) and SECRET not in str(caught.value)


def test_names_with_a_trailing_newline_are_refused() -> None:
    """A regex's `$` also matches before a final newline, and a value read from a file or a Kubernetes
    ConfigMap often ends in one: 'orders\\n' passed as a default topic (a name Kafka refuses), a sink name,
    a retention class. Every name check must refuse it at start, naming the setting."""
    from outbox_relay import history
    from outbox_relay.sinks import check_sink
    from projections import projection

    secret = "whsec_" + "A" * 40
    for kw in ({"default_topic": "orders\n"}, {"webhook_sink": "hooks\n", "webhook_url": "http://x/",
                                                "webhook_secret": secret},
               {"webhook_url": "http://x/", "webhook_secret": secret, "webhook_topics": ["orders\n"]}):
        with pytest.raises(ConfigurationError):
            load_settings(dsn="postgresql://x@h/db", kafka=False, **kw)

    class Sink:
        kind = "audit"

        def __init__(self, name: str, kind: str = "audit") -> None:
            self.name, self.kind = name, kind

        def deliver(self, event: object) -> None:
            return None

    for sink in (Sink("audit\n"), Sink("audit", "audit\n")):
        with pytest.raises(ConfigurationError, match="is not a sink"):
            check_sink(sink)
    with pytest.raises(ConfigurationError, match="invalid"):
        history.check_class_name("short\n")
    with pytest.raises(ConfigurationError, match="not a Kafka topic name"):
        history.map_topic(None, "orders\n", "short")  # type: ignore[arg-type]  # refused before any SQL
    with pytest.raises(ConfigurationError):
        projection("totals\n", events=["x"], tables=["t"])(lambda event, tx: None)


def test_no_validator_of_one_sinks_settings_hides_anothers() -> None:
    """pydantic keys validators by method name: in RelaySettings, a base's ``_url`` silently replaced
    another base's ``_url`` (the NATS sink's URL check never ran). Each name must be declared once."""
    kinds = ("field_validators", "model_validators", "field_serializers", "model_serializers")
    declared: dict[str, list[str]] = {}
    for cls in RelaySettings.__mro__:
        decorators = cls.__dict__.get("__pydantic_decorators__")
        if decorators is not None:
            names = {name for kind in kinds for name in getattr(decorators, kind)}
            for name in names & cls.__dict__.keys():  # declared in this class's own body
                declared.setdefault(name, []).append(cls.__qualname__)
    assert declared, "no validators found: the check reads nothing"
    assert not {n: c for n, c in declared.items() if len(c) > 1}
