"""``outbox-relay inbox``: migrate, run, status, dead-letters (parsing and printing only; ``admin.py`` acts).

The main CLI registers it with ``add_parser(subparsers)`` and dispatches ``inbox`` to ``command(args)``;
errors it raises (OutboxError, psycopg errors) are printed by the main CLI like its own.
"""

from __future__ import annotations

import argparse
import base64
import json
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from pydantic.fields import FieldInfo

from ..errors import ConfigurationError
from ..loader import import_module
from ..settings_base import default_text
from . import admin
from .consumer import InboxConsumer
from .schema import check_inbox_schema, connect, migrate_inbox
from .settings import ENV_PREFIX, InboxSettings, env_var, env_vars, load_inbox_settings
from .store import Handler

EXIT_OK = 0
LIMITS = (1, 1000)
DEAD_LETTER_ACTIONS = {
    "list": "dead letters of --consumer, newest first (--topic, --limit; --after ID pages)",
    "show": "one dead letter whole: headers, key, value, last error (--id)",
    "retry": "ask the running consumers to apply dead letters again (--id, repeatable, or --all); each is applied "
             "once, deduplicated by its ce_id, and late: after the later messages of its partition, which were "
             "applied when it was dead-lettered (the handler sees message.late); one that fails again, or stops "
             "the process, stays with its new error until asked again",
    "drop": "delete dead letters for good (--id, repeatable, or --all)",
}


def add_parser(subparsers: Any) -> None:
    """Add ``inbox`` and its commands to the main CLI's subparsers."""
    p = subparsers.add_parser("inbox", help="the consumer-side inbox: apply the relay's Kafka messages exactly once "
                                            "in your database (migrate, run, status, dead-letters)")
    actions = p.add_subparsers(dest="inbox_command", required=True)

    a = actions.add_parser("migrate", help="create or update the inbox tables (schema outbox_inbox)")
    _dsn(a)

    a = actions.add_parser("run", help="consume --topic and apply each message with --handler until SIGTERM")
    for name, field in InboxSettings.model_fields.items():
        _setting(a, name, field)

    a = actions.add_parser("status", help="per partition of --consumer: next offset, lease owner, applied, "
                                          "duplicates skipped, dead letters")
    _dsn(a)
    _consumer(a)
    a.add_argument("--json", action="store_true", help="machine-readable output")

    summary = "list, show, retry or drop the inbox's dead letters"
    a = actions.add_parser("dead-letters", help=summary, description=summary + ": " + "; ".join(
        f"{k}: {v}" for k, v in DEAD_LETTER_ACTIONS.items()))
    _dsn(a)
    _consumer(a)
    a.add_argument("action", choices=list(DEAD_LETTER_ACTIONS), help="what to do (see above)")
    a.add_argument("--id", dest="ids", action="append", type=_positive, default=None, help="a dead letter's id")
    a.add_argument("--all", action="store_true", help="retry/drop every dead letter of the consumer")
    a.add_argument("--topic", default=None, help="list: only this topic")
    a.add_argument("--limit", type=_positive, default=50, help=f"list at most this many ({LIMITS[0]}-{LIMITS[1]})")
    a.add_argument("--after", type=_positive, default=None, metavar="ID", help="list: the page after this id")
    a.add_argument("--json", action="store_true", help="machine-readable output")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text[:100]!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def _dsn(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dsn", default=None, help=f"PostgreSQL connection string (default: {env_var('dsn')})")


def _consumer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--consumer", default=None,
                   help=f"the consumer's name (default: {env_var('consumer')}, else "
                        f"{InboxSettings.model_fields['consumer'].default})")


def _setting(p: argparse.ArgumentParser, name: str, field: FieldInfo) -> None:
    default = "host-pid" if name == "member_id" else default_text(name, field)
    text = f"{field.description} (default: {default}; {env_var(name)})"
    if name == "topics":
        p.add_argument("--topic", dest="topics", action="append", default=None, help=text + "; repeatable")
    elif name == "kafka_config":
        p.add_argument("--kafka-option", dest="kafka_config", action="append", default=None, metavar="KEY=VALUE",
                       help=text + "; repeatable")
    else:
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=text)


def command(args: argparse.Namespace) -> int:
    """Run the ``inbox`` command the parsed arguments name; returns the exit status."""
    run = {"migrate": cmd_migrate, "run": cmd_run, "status": cmd_status, "dead-letters": cmd_dead_letters}
    return run[args.inbox_command](args)


def _dsn_of(args: argparse.Namespace) -> str:
    import os

    from ..dsn import check_dsn, remember_dsn

    dsn = args.dsn or next((os.environ[v] for v in env_vars("dsn") if os.environ.get(v)), "")
    if not dsn.strip():
        raise ConfigurationError(f"no database given: pass --dsn or set {env_var('dsn')}")
    remember_dsn(dsn)
    check_dsn(dsn)
    return dsn


def _consumer_of(args: argparse.Namespace) -> str:
    import os

    name: str = args.consumer or os.environ.get(env_var("consumer")) or str(
        InboxSettings.model_fields["consumer"].default)
    return name


def cmd_migrate(args: argparse.Namespace) -> int:
    with connect(_dsn_of(args), autocommit=True) as conn:
        applied = migrate_inbox(conn)
    print(f"applied {', '.join(applied)}" if applied else "the inbox tables are up to date")
    return EXIT_OK


def load_handler(spec: str) -> Handler:
    """``MODULE:ATTR`` -> the callable, or ConfigurationError saying what is wrong with it."""
    module_name, _, attr = spec.partition(":")
    module = import_module(module_name, f"--handler {spec}")
    found = getattr(module, attr, None)
    if found is None:
        raise ConfigurationError(f"module {module_name!r} has no attribute {attr!r} (--handler {spec})")
    if not callable(found):
        raise ConfigurationError(f"--handler {spec} is a {type(found).__name__}, not a callable "
                                 "handler(message, connection)")
    handler: Handler = found
    return handler


def _kafka_options(values: Sequence[str] | None) -> dict[str, str] | None:
    if not values:
        return None
    options = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigurationError("--kafka-option takes KEY=VALUE")  # no value echoed: it may be a secret
        options[key.strip()] = value
    return options


def cmd_run(args: argparse.Namespace) -> int:
    values = {name: getattr(args, name, None) for name in InboxSettings.model_fields}
    values["kafka_config"] = _kafka_options(args.kafka_config)
    settings = load_inbox_settings(**values)
    if settings.handler is None:
        raise ConfigurationError(f"no handler given: pass --handler MODULE:ATTR or set {ENV_PREFIX}HANDLER")
    handler = load_handler(settings.handler)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()  # the message in hand is finished, the leases given up

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    consumer = InboxConsumer(settings, handler)
    consumer.run(stop)
    s = consumer.stats
    print(f"stopped: {s.applied} applied, {s.duplicates} duplicates skipped, {s.dead} dead-lettered", file=sys.stderr)
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    with connect(_dsn_of(args), autocommit=True) as conn:
        check_inbox_schema(conn)
        rows = admin.positions(conn, _consumer_of(args))
    _output(rows, args.json, "no positions (the consumer never ran)")
    return EXIT_OK


def cmd_dead_letters(args: argparse.Namespace) -> int:
    consumer = _consumer_of(args)
    with connect(_dsn_of(args), autocommit=True) as conn:
        check_inbox_schema(conn)
        if args.action == "list":
            if not LIMITS[0] <= args.limit <= LIMITS[1]:
                raise ConfigurationError(f"--limit must be {LIMITS[0]}-{LIMITS[1]}")
            rows = admin.list_dead_letters(conn, consumer, topic=args.topic, after=args.after, limit=args.limit)
            _output(rows, args.json, "no dead letters")
            if len(rows) == args.limit:
                print(f"more: outbox-relay inbox dead-letters list --consumer {consumer} --after {rows[-1]['id']}",
                      file=sys.stderr)
            return EXIT_OK
        if args.action == "show":
            if not args.ids or len(args.ids) != 1:
                raise ConfigurationError("dead-letters show needs one --id")
            row = admin.show_dead_letter(conn, consumer, args.ids[0])
            _show(row, args.json)
            return EXIT_OK
        if not args.ids and not args.all:
            raise ConfigurationError(f"dead-letters {args.action} needs --id or --all")
        if args.ids and args.all:
            raise ConfigurationError(f"dead-letters {args.action}: give --id or --all, not both")
        act = admin.request_retry if args.action == "retry" else admin.drop_dead_letters
        ids = act(conn, consumer, None if args.all else args.ids)
    if args.json:
        print(json.dumps({"action": args.action, "consumer": consumer, "ids": ids}))
    else:
        verb = "asked to retry (a running consumer applies them, after the later messages of their partitions)" \
            if args.action == "retry" else "dropped"
        print(f"{len(ids)} dead letters {verb}")
    return EXIT_OK


def _text(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(raw).decode()
    if isinstance(value, list):
        return [_text(v) for v in value]
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def _printable(value: Any) -> str:
    """A producer's text as the terminal should show it: control and bidi characters escaped."""
    from ..cli.output import printable  # here: the main CLI imports this module

    return printable(str(value))


def _show(row: dict[str, Any], as_json: bool) -> None:
    names, values = row.pop("header_names") or [], row.pop("header_values") or []
    record = {k: _text(v) for k, v in row.items()}
    record["headers"] = {n: _text(v) for n, v in zip(names, values, strict=True)}
    if as_json:
        print(json.dumps(record))
        return
    for k, v in record.items():
        print(f"{k}: {_printable(v)}")  # a producer's bytes never reach the terminal as escapes


def _output(rows: list[dict[str, Any]], as_json: bool, empty: str) -> None:
    records = [{k: _text(v) for k, v in r.items()} for r in rows]
    if as_json:
        print(json.dumps(records))
        return
    if not records:
        print(empty)
        return
    cols = list(records[0])
    cells = [cols] + [["" if r[c] is None else " ".join(_printable(r[c]).split()) for c in cols] for r in records]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for i, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
