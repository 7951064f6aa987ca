"""What every command shares: exit codes, argument types, the settings and DSN an invocation names, and
the connection to a migrated database."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import Any

import psycopg
from pydantic.fields import FieldInfo

from ..dsn import check_dsn, describe, remember_dsn
from ..errors import ConfigurationError, OutboxError
from ..event import MAX_KEY_BYTES
from ..migrate import check_schema
from ..settings import NO_DSN, TOPIC_NAME, RelaySettings, bounds, default_text, env_var, load_settings
from . import logs
from .output import _say

log = logging.getLogger("outbox_relay.cli")


# Exit codes (README / docs/configuration.md list them).
EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and some of its work failed (replay: events it could not send)
EXIT_ERROR = 2  # nothing (more) done: bad arguments or settings, database unreachable or not migrated, refused
EXIT_INTERNAL = 3  # an unexpected exception (a bug): one line, the traceback with --log-level debug
EXIT_STOPPED = 4  # run: the relay stopped by itself, because one of its sinks can not go on (dropped)
EXIT_INTERRUPTED = 130  # rebuild/replay stopped by a signal; run the same command again to resume

LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_ATTEMPTS = (1, 1000)  # RelaySettings.max_attempts


def _add_setting(parser: argparse.ArgumentParser, name: str, field: FieldInfo) -> None:
    option = "--" + name.replace("_", "-")
    allowed = bounds(field)
    default = default_text(name, field)
    help_text = (f"{field.description or name}" + (f" ({allowed})" if allowed else "")
                 + (" (required)" if default == "required" else f" (default {default})") + f" [env {env_var(name)}]")
    if name in ("webhook_secret", "rabbitmq_password"):
        return  # the environment or --webhook-secret-file only: a command line shows in `ps`
    if field.annotation is bool:
        parser.add_argument(option, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    elif name == "projection":
        parser.add_argument(option, dest=name, action="append", metavar="NAME", default=None, help=help_text)
    elif name == "sink":
        parser.add_argument(option, dest=name, action="append", metavar="MODULE:ATTR", default=None, help=help_text)
    elif name == "kafka_config":
        parser.add_argument("--kafka-option", dest=name, action="append", metavar="KEY=VALUE", default=None,
                            help="librdkafka setting, repeatable (TLS/SASL pass through); KEY=@PATH reads the value "
                                 f"from a file, so secrets stay out of `ps` (default none) [env {env_var(name)} as "
                                 "JSON]")
    else:
        parser.add_argument(option, dest=name, default=None, help=help_text)


def _dsn_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", default=None, help=f"PostgreSQL connection string (required) [env {env_var('dsn')}]")


def _log_level(text: str) -> str:
    level = text.lower()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level ({', '.join(LOG_LEVELS)})")
    return level


def _event_id(text: str) -> str:
    try:
        return str(uuid.UUID(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"an event id is a UUID, not {text[:100]!r}") from None


def _partition_key(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a partition key is not empty")
    if len(text.encode()) > MAX_KEY_BYTES:
        raise argparse.ArgumentTypeError(f"a partition key is at most {MAX_KEY_BYTES} bytes, not "
                                         f"{len(text.encode())}")
    return text


def _int_between(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text[:100]!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low}-{high}, not {value}")
        return value
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text[:100]!r}") from None
    if not 0.02 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be 0.02-3600 seconds, not {text[:100]}")
    return value


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _keep(text: str) -> float | str:
    """A retention: seconds, a number with a unit (s, m, h, d), 'forever' or 'relays'."""
    word = text.strip().lower()
    if word in ("forever", "relays"):
        return word
    unit = _UNITS.get(word[-1:])
    try:
        value = float(word[:-1] if unit else word) * (unit or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text[:100]!r} (seconds, 7d, 12h, 30m, 'forever' or "
                                         "'relays')") from None
    if not 0 <= value <= 3650 * 86400:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 to 3650 days, not {text[:100]}")
    return value


MAX_RETENTION_SECONDS = 3650 * 86400.0  # RelaySettings.retention_seconds' bound


def _retention(text: str) -> float:
    """The relays' --retention-seconds as they accept it: 0 to 3650 days (NaN, infinite and negative refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text[:100]!r}") from None
    if not 0 <= value <= MAX_RETENTION_SECONDS:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 to {MAX_RETENTION_SECONDS:.0f} seconds (3650 days), "
                                         f"not {text[:100]}")
    return value


def _retention_seconds(args: argparse.Namespace) -> float:
    """The relays' --retention-seconds (what the default retention class keeps unless set): the option,
    else the environment, else the relays' default."""
    if getattr(args, "retention_seconds", None) is not None:
        return float(args.retention_seconds)
    text = os.environ.get(env_var("retention_seconds"))
    try:
        return _retention(text) if text else float(RelaySettings.model_fields["retention_seconds"].default)
    except argparse.ArgumentTypeError as exc:
        raise ConfigurationError(f"{env_var('retention_seconds')}: {exc}") from None


def _global_options(parser: argparse.ArgumentParser, default: Callable[[Any], Any]) -> None:
    parser.add_argument("--log-level", type=_log_level, default=default("info"),
                        help="debug, info, warning, error (debug also prints the traceback of an unexpected error; "
                             "default info)")
    parser.add_argument("--log-json", action="store_true", default=default(False),
                        help="one JSON object per log line")


def _topic(text: str) -> str:
    if not TOPIC_NAME.match(text) or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"{text[:300]!r} is not a valid topic name (1-249 of A-Z a-z 0-9 . _ -, "
                                         "not . or ..)")
    return text


def _key_args(parser: argparse.ArgumentParser, sink_required: bool = True) -> None:
    _dsn_arg(parser)
    parser.add_argument("key", type=_partition_key, metavar="KEY", help="the partition key")
    parser.add_argument("--sink", required=sink_required, default=None,
                        help="the sink (kafka, a projection's name)" + ("" if sink_required else "; default: all"))
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _timestamp(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO-8601 time: {text!r}") from None
    return value if value.tzinfo else value.astimezone()


def _position(text: str) -> tuple[int, int]:
    xid, sep, seq = text.partition(":")
    if not (sep and xid.isdigit() and seq.isdigit()):
        raise argparse.ArgumentTypeError(f"a position is XID:SEQ (two integers, as in ce_sequence), not {text!r}")
    return int(xid), int(seq)


def _settings_from(args: argparse.Namespace) -> RelaySettings:
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


def _dsn(args: argparse.Namespace) -> str:
    # Only the DSN: a bad value of some other OUTBOX_* variable must not stop `status`.
    dsn = args.dsn or os.environ.get(env_var("dsn"))
    if not dsn or not dsn.strip():  # libpq reads "" as every default
        raise ConfigurationError(NO_DSN)
    remember_dsn(dsn)
    check_dsn(dsn)
    return dsn


def _using(dsn: str) -> None:
    """Name the database a command uses, once, on stderr (stdout stays pure for --json); with
    --log-json as a log record, so that stderr stays one JSON object per line."""
    if logs._json_logs:
        log.info("using %s", describe(dsn))
    else:
        _say(f"outbox-relay: using {describe(dsn)}", file=sys.stderr)


@contextlib.contextmanager
def _database(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection to a migrated database (else SchemaError: run `outbox-relay migrate`)."""
    with psycopg.connect(dsn, autocommit=True, application_name="outbox-relay cli") as conn:
        check_schema(conn)
        _using(dsn)
        yield conn


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (the action lists), and every option's default unless it has none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or "default" in text
                or not action.option_strings):
            return text
        return f"{text} (default {default})"


def _actions_description(summary: str, actions: dict[str, str]) -> str:
    """A command's description with one line per action (argparse gives choices no help of their own)."""
    width = max(len(a) for a in actions) + 2
    return summary + "\n\nactions:\n" + "\n".join(f"  {a.ljust(width)}{h}" for a, h in actions.items())


def _parser_with(common: argparse.ArgumentParser) -> type[argparse.ArgumentParser]:
    class Subcommand(argparse.ArgumentParser):
        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("formatter_class", _HelpFormatter)
            super().__init__(parents=[common], **kwargs)

    return Subcommand


def _registry(spec: str) -> Any:
    """The projections of a module; an import that raises anything is a configuration error."""
    from projections.declare import load_registry

    try:
        return load_registry(spec)
    except OutboxError:
        raise
    except Exception as exc:
        raise ConfigurationError(f"cannot import projections module {spec.partition(':')[0]!r}: "
                                 f"{type(exc).__name__}: {exc}") from None
