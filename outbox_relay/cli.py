"""``outbox-relay``: migrate, run, status, lag, dead-letters, sinks, rebuild, replay.

Every option of ``run`` is a RelaySettings field and can also come from the environment
variable named in ``--help``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from types import FrameType
from typing import Any

import psycopg
from pydantic.fields import FieldInfo

from .dsn import redact
from .errors import OutboxError
from .migrate import migrate
from .settings import ENV_PREFIX, RelaySettings, load_settings
from .sink import Aborted
from .sqlfiles import query

log = logging.getLogger("outbox_relay.cli")


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


def setup_logging(level: str, as_json: bool, worker_id: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_WorkerIdFilter(worker_id))
    handler.setFormatter(_JsonFormatter() if as_json else _RedactingFormatter(
        "%(asctime)s %(levelname)s %(name)s [worker=%(worker_id)s %(threadName)s] %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _env(name: str) -> str:
    return f"{ENV_PREFIX}{name.upper()}"


def _add_setting(parser: argparse.ArgumentParser, name: str, field: FieldInfo) -> None:
    flag = "--" + name.replace("_", "-")
    help_text = f"{field.description or name} [env {_env(name)}]"
    if field.annotation is bool:
        parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    elif name == "projection":
        parser.add_argument(flag, dest=name, action="append", metavar="NAME", default=None, help=help_text)
    elif name == "kafka_config":
        parser.add_argument("--kafka-option", dest=name, action="append", metavar="KEY=VALUE", default=None,
                            help=f"librdkafka setting, repeatable (TLS/SASL pass through) [env {_env(name)} as JSON]")
    else:
        parser.add_argument(flag, dest=name, default=None, help=help_text)


def _dsn_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", default=None, help=f"PostgreSQL connection string [env {_env('dsn')}]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outbox-relay", description=__doc__)
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
    parser.add_argument("--log-json", action="store_true", help="one JSON object per log line")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("migrate", help="create or update the outbox schema (safe to run concurrently)")
    _dsn_arg(p)

    p = sub.add_parser("run", help="run a relay worker until SIGTERM (drain) or a second signal (hard stop)")
    for name, field in RelaySettings.model_fields.items():
        _add_setting(p, name, field)

    p = sub.add_parser("status", help="workers, their buckets, backlog per sink, dead letters by key")
    _dsn_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("lag", help="per sink: events not yet delivered, the oldest one's age, retrying, dead")
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

    p = sub.add_parser("sinks", help="list sinks, or drop a retired one (its progress, retries, dead letters)")
    _dsn_arg(p)
    p.add_argument("action", choices=["list", "drop"])
    p.add_argument("name", nargs="?", default=None, help="the sink to drop")

    p = sub.add_parser("dead-letters", help="list, retry or discard dead letters")
    _dsn_arg(p)
    p.add_argument("action", choices=["list", "retry", "discard"])
    p.add_argument("--sink", default=None, help="sink name (required for retry and discard)")
    p.add_argument("--key", default=None, help="only this partition key")
    p.add_argument("--event", dest="events", action="append", default=None, help="only this event id (repeatable)")
    p.add_argument("--all", action="store_true", help="retry/discard every dead letter of the sink")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


# What `rebuild` reads of the relay settings (the rest is about Kafka and the ring).
REBUILD_SETTINGS = ("dsn", "projections", "worker_id", "batch_size", "lease_seconds", "max_attempts",
                    "backoff_base_seconds", "backoff_max_seconds")


# What `replay` reads of the relay settings.
REPLAY_SETTINGS = ("dsn", "kafka_bootstrap_servers", "kafka_config", "kafka_stall_seconds", "default_topic",
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
            pairs = [v.split("=", 1) for v in value]
            bad = [v for v, p in zip(value, pairs, strict=True) if len(p) != 2]
            if bad:
                raise OutboxError(f"--kafka-option needs KEY=VALUE, got {bad[0]!r}")
            value = dict(pairs)
        overrides[name] = value
    return load_settings(**overrides)


def _dsn(args: argparse.Namespace) -> str:
    return args.dsn or load_settings().dsn.get_secret_value()


def _print_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> None:
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for i, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _query_rows(dsn: str, group: str, name: str, params: dict[str, Any] | None = None
                ) -> tuple[list[str], list[tuple[Any, ...]]]:
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        cur.execute(query(group, name), params or {})
        cols = [d.name for d in cur.description or []]
        return cols, list(cur.fetchall())


def cmd_status(args: argparse.Namespace) -> int:
    dsn = _dsn(args)
    sections = {
        "workers": _query_rows(dsn, "admin", "workers"),
        "backlog": _query_rows(dsn, "admin", "backlog"),
        "oldest open transaction (holds back delivery)": _query_rows(dsn, "admin", "horizon_holder"),
        "dead letters by key": _query_rows(dsn, "admin", "dead_letters_by_key", {"sink": None, "limit": 20}),
        "rebuilds in progress": _query_rows(dsn, "admin", "rebuilds"),
    }
    if args.json:
        print(json.dumps({k: [dict(zip(c, r, strict=True)) for r in rows] for k, (c, rows) in sections.items()},
                         default=str, indent=2))
        return 0
    for title, (cols, rows) in sections.items():
        print(f"\n{title}:")
        _print_table(rows, cols) if rows else print("  (none)")
    return 0


def cmd_dead_letters(args: argparse.Namespace) -> int:
    dsn = _dsn(args)
    if args.action == "list":
        params = {"sink": args.sink, "key": args.key, "limit": args.limit}
        cols, rows = _query_rows(dsn, "admin", "dead_letters", params)
        if args.json:
            print(json.dumps([dict(zip(cols, r, strict=True)) for r in rows], default=str, indent=2))
        else:
            _print_table(rows, cols) if rows else print("no dead letters")
        return 0
    if not args.sink:
        raise OutboxError(f"dead-letters {args.action} needs --sink")
    if not (args.events or args.key or args.all):
        raise OutboxError(f"dead-letters {args.action} needs --event, --key or --all")
    name = "retry_dead_letters" if args.action == "retry" else "discard_dead_letters"
    _, rows = _query_rows(dsn, "admin", name, {"sink": args.sink, "event_ids": args.events, "key": args.key})
    verb = "queued for retry" if args.action == "retry" else "discarded"
    print(f"{len(rows)} dead letters {verb}")
    return 0


def cmd_lag(args: argparse.Namespace) -> int:
    cols, rows = _query_rows(_dsn(args), "admin", "backlog")
    if args.sink:
        rows = [r for r in rows if r[0] == args.sink]
        if not rows:
            raise OutboxError(f"no sink named {args.sink!r}")
    if args.json:
        print(json.dumps([dict(zip(cols, r, strict=True)) for r in rows], default=str, indent=2))
    else:
        _print_table(rows, cols) if rows else print("no sinks")
    return 0


def cmd_sinks(args: argparse.Namespace) -> int:
    dsn = _dsn(args)
    if args.action == "list":
        cols, rows = _query_rows(dsn, "admin", "backlog")
        _print_table([r[:3] for r in rows], cols[:3]) if rows else print("no sinks")
        return 0
    if not args.name:
        raise OutboxError("sinks drop needs the sink's name")
    _, rows = _query_rows(dsn, "admin", "drop_sink", {"sink": args.name})
    if not rows:
        raise OutboxError(f"no sink named {args.name!r}")
    print(f"dropped sink {args.name!r} ({rows[0][0]}): its cursors, parked events and dead letters are gone")
    return 0


def cmd_rebuild(args: argparse.Namespace) -> int:
    from projections.declare import load_registry
    from projections.rebuild import Rebuild, rebuild_key

    settings = _settings_from(args)
    if not settings.projections:
        raise OutboxError("rebuild needs --projections (the module that declares the projection)")
    projection = load_registry(settings.projections).get(args.projection_name)
    if args.key is not None:
        n = rebuild_key(projection, settings.dsn.get_secret_value(), args.key)
        print(f"rebuilt key {args.key!r} of {projection.name!r}: {n} events replayed")
        return 0
    rebuild = Rebuild(projection, settings, from_time=args.from_time, from_position=args.from_position,
                      restart=args.restart, keep_old=args.keep_old)
    if args.cancel:
        print(f"rebuild of {projection.name!r} " + ("cancelled" if rebuild.cancel() else "was not in progress"))
        return 0

    def interrupted(signum: int, _frame: FrameType | None) -> None:
        log.warning("%s: stopping the rebuild; run the same command again to resume", signal.Signals(signum).name)
        rebuild.stop()

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    result = rebuild.run()
    if result is None:
        print(f"rebuild of {projection.name!r} interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    print(f"rebuilt {projection.name!r}: {result.events} events in {result.seconds:.1f}s"
          + (" (resumed)" if result.resumed else ""))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from .replay import replay

    settings = _settings_from(args)
    if args.from_time and args.to_time and args.from_time >= args.to_time:
        raise OutboxError("--from-time must be before --to-time")
    stop = threading.Event()

    def interrupted(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        result = replay(settings, args.topic, from_time=args.from_time, to_time=args.to_time, key=args.key,
                        to_topic=args.to_topic, abort=stop)
    except Aborted:
        print("replay interrupted: what was acknowledged so far stays on the topic", file=sys.stderr)
        return 130
    for event_id, error in result.failed[:20]:
        print(f"failed: {event_id}: {error}", file=sys.stderr)
    print(f"replayed {result.sent} events" + (f"; {len(result.failed)} failed" if result.failed else ""))
    return 1 if result.failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            settings = _settings_from(args)
            setup_logging(args.log_level, args.log_json, settings.worker_id)
            from .worker import Worker

            worker = Worker(settings)
            worker.run()
            if worker.fatal is not None:
                print(f"outbox-relay: error: {redact(str(worker.fatal))}", file=sys.stderr)
                return 4
            return 0
        setup_logging(args.log_level, args.log_json, "-")
        if args.command == "migrate":
            applied = migrate(_dsn(args))
            print(f"applied {len(applied)} migrations" + (": " + ", ".join(f"{m.version:04d}_{m.name}" for m in applied)
                                                         if applied else " (schema up to date)"))
            return 0
        if args.command == "status":
            return cmd_status(args)
        if args.command == "dead-letters":
            return cmd_dead_letters(args)
        if args.command == "lag":
            return cmd_lag(args)
        if args.command == "sinks":
            return cmd_sinks(args)
        if args.command == "rebuild":
            return cmd_rebuild(args)
        if args.command == "replay":
            return cmd_replay(args)
    except OutboxError as exc:
        print(f"outbox-relay: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        print(f"outbox-relay: database error: {redact(str(exc))}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
