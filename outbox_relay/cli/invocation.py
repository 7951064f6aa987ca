"""What an invocation names, resolved: its relay settings, its DSN, the relays' retention, its projections
module, and the connection to a migrated database (named once on stderr)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg

from ..dsn import check_dsn, describe, remember_dsn
from ..errors import ConfigurationError, OutboxError
from ..migrate import check_schema
from ..settings import NO_DSN, RelaySettings, env_var, load_settings
from .logs import logs_as_json
from .output import say
from .values import retention_seconds

log = logging.getLogger("outbox_relay.cli")


def settings_from_args(args: argparse.Namespace) -> RelaySettings:
    overrides: dict[str, Any] = {}
    for name in RelaySettings.model_fields:
        value = getattr(args, name, None)
        if value is None:
            continue
        if name == "kafka_config":
            value = {**_kafka_config_env(), **_kafka_options(value)}
        overrides[name] = value
    return load_settings(**overrides)


def _kafka_options(options: Sequence[str]) -> dict[str, str]:
    config: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key.strip():
            # Not the option itself: it may be a secret that lost its key.
            raise ConfigurationError("--kafka-option needs KEY=VALUE (the option given has no KEY=)")
        config[key.strip()] = value
    return config


def _kafka_config_env() -> dict[str, str]:
    """OUTBOX_KAFKA_CONFIG, so that --kafka-option is merged over it rather than replacing it."""
    text = os.environ.get(env_var("kafka_config"))
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        raise ConfigurationError(f"{env_var('kafka_config')} is not valid JSON") from None
    if not isinstance(value, dict):
        raise ConfigurationError(f"{env_var('kafka_config')} must be a JSON object of strings")
    return value


def dsn_from_args(args: argparse.Namespace) -> str:
    # Only the DSN: a bad value of some other OUTBOX_* variable must not stop `status`.
    dsn = args.dsn or os.environ.get(env_var("dsn"))
    if not dsn or not dsn.strip():  # libpq reads "" as every default
        raise ConfigurationError(NO_DSN)
    remember_dsn(dsn)
    check_dsn(dsn)
    return dsn


_Number = TypeVar("_Number", int, float)


def relays_setting(args: argparse.Namespace, name: str, parse: Callable[[str], _Number],
                   kind: type[_Number]) -> _Number:
    """A relay setting that a command must know as the relays have it (``--max-attempts`` for "attempt 3 of
    N", ``--retention-seconds``, ``--worker-ttl-seconds``): the command's option, else the relays'
    environment variable (parsed as the option is), else the relays' default."""
    if getattr(args, name, None) is not None:
        return kind(getattr(args, name))
    text = os.environ.get(env_var(name))
    try:
        return kind(parse(text)) if text else kind(RelaySettings.model_fields[name].default)
    except argparse.ArgumentTypeError as exc:
        raise ConfigurationError(f"{env_var(name)}: {exc}") from None


def relays_retention_seconds(args: argparse.Namespace) -> float:
    """The relays' --retention-seconds: what the default retention class keeps unless set."""
    return relays_setting(args, "retention_seconds", retention_seconds, float)


def announce_database(dsn: str) -> None:
    """Name the database a command uses, once, on stderr (stdout stays pure for --json); with
    --log-json as a log record, so that stderr stays one JSON object per line."""
    if logs_as_json():
        log.info("using %s", describe(dsn))
    else:
        say(f"outbox-relay: using {describe(dsn)}", file=sys.stderr)


@contextlib.contextmanager
def migrated_database(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection to a migrated database (else SchemaError: run `outbox-relay migrate`)."""
    with psycopg.connect(dsn, autocommit=True, application_name="outbox-relay cli") as conn:
        check_schema(conn)
        announce_database(dsn)
        yield conn


def load_projections(spec: str) -> Any:
    """The projections of a module; an import that raises anything is a configuration error."""
    from projections.declare import load_registry

    try:
        return load_registry(spec)
    except OutboxError:
        raise
    except Exception as exc:
        raise ConfigurationError(f"cannot import projections module {spec.partition(':')[0]!r}: "
                                 f"{type(exc).__name__}: {exc}") from None
