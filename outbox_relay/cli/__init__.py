"""The ``outbox-relay`` command: every command is registered here (see DESCRIPTION for its --help)."""

# Every command is registered here, in
# build_parser (its arguments) and COMMANDS (what runs it); the commands live in one module per group:
# operate.py (status, lag, dead-letters, retention, sinks, keys: calls of outbox_relay.admin), relays.py (run,
# migrate, grants, dev, rebuild, replay) and verify.py; values.py holds the argument types, parsers.py the
# shared options and help format, invocation.py what an invocation's settings, DSN and database resolve to,
# exit_codes.py the exit statuses, output.py the printing, logs.py the log format.

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import psycopg
from confluent_kafka import KafkaException

from ..admin import DEAD_LETTERS_LIMIT, SKIPPED_ERROR
from ..dsn import connection_problem, redact
from ..errors import OutboxError
from ..inbox import cli as inbox_cli
from ..privileges import SCHEMAS
from ..settings import RelaySettings, env_var, listed_fields
from . import console as console_cli
from .exit_codes import EXIT_ERROR, EXIT_FAILED, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_STOPPED
from .logs import setup_logging
from .operate import (
    DEAD_LETTERS_ACTIONS,
    RETENTION_ACTIONS,
    SINKS_ACTIONS,
    cmd_dead_letters,
    cmd_keys,
    cmd_lag,
    cmd_retention,
    cmd_sinks,
    cmd_status,
)
from .output import say, say_error
from .parsers import (
    HelpFormatter,
    add_dsn_option,
    add_global_options,
    add_key_arguments,
    add_setting_option,
    describe_actions,
    subcommand_class,
)
from .relays import (
    DEFAULT_DEV_TOPIC,
    REBUILD_SETTINGS,
    REPLAY_SETTINGS,
    cmd_dev,
    cmd_grants,
    cmd_migrate,
    cmd_rebuild,
    cmd_replay,
    cmd_run,
)
from .values import (
    MAX_ATTEMPTS,
    event_id,
    int_between,
    iso_time,
    partition_key,
    position,
    retention_keep,
    retention_seconds,
    seconds,
    topic_name,
)
from .verify import add_parser as add_verify_parser
from .verify import cmd_verify

__all__ = [
    "COMMANDS",
    "EXIT_ERROR",
    "EXIT_FAILED",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_STOPPED",
    "SKIPPED_ERROR",
    "build_parser",
    "main",
    "version",
]


def version() -> str:
    from .. import __version__

    return str(__version__)


# The top-level --help: plain text (a docstring's ``markup`` showed as is), every command named.
DESCRIPTION = """outbox-relay: migrate, grants, run, status, lag, dead-letters, retention, keys, sinks, rebuild, replay,
verify, dev, console, inbox.

Every option of `run` can also come from the environment variable its --help names (OUTBOX_*)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outbox-relay", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    add_global_options(parser, lambda value: value)
    # The same options after the command (`outbox-relay status --log-level debug`); SUPPRESS keeps a
    # subcommand that was not given them from resetting what came before the command.
    common = argparse.ArgumentParser(add_help=False)
    add_global_options(common, lambda _value: argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=subcommand_class(common))

    p = sub.add_parser("migrate", help="create or update the outbox schema (safe to run concurrently)")
    add_dsn_option(p)

    p = sub.add_parser("grants", help="print the SQL that grants the product's roles their rights (run it as the "
                                      "migrator after every migrate; it takes everything back first)")
    p.add_argument("--schema", choices=SCHEMAS, default=SCHEMAS[0],
                   help="the schema whose grants to print: outbox (the relay's), or outbox_inbox once "
                        "`inbox migrate` made it (default outbox)")

    p = sub.add_parser("run", help="run a relay worker until SIGTERM (drain) or a second signal (hard stop)")
    for name, field in listed_fields().items():
        add_setting_option(p, name, field)

    p = sub.add_parser("status", help="workers, their buckets, backlog per sink, dead letters by key")
    add_dsn_option(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all-databases", action="store_true",
                   help="the oldest open transaction of the whole server (they all hold back vacuum), not only of "
                        "the outbox's database")

    p = sub.add_parser("lag", help="per sink: events not yet delivered, the oldest one's age, retrying, paused, "
                                   "dead")
    add_dsn_option(p)
    p.add_argument("--sink", default=None, help="only this sink")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("rebuild", help="rebuild a projection's read model from stored events, then switch it in")
    p.add_argument("projection_name", metavar="PROJECTION", help="the projection to rebuild")
    for name in REBUILD_SETTINGS:
        add_setting_option(p, name, RelaySettings.model_fields[name])
    p.add_argument("--from-time", type=iso_time, default=None, metavar="ISO-8601",
                   help="replay only events from this time on (earlier history is skipped)")
    p.add_argument("--from-position", type=position, default=None, metavar="XID:SEQ",
                   help="replay only events from this position on")
    p.add_argument("--key", type=partition_key, default=None,
                   help="rebuild only this partition key, in place (needs a key_reset)")
    p.add_argument("--restart", action="store_true", help="discard a rebuild in progress and start over")
    p.add_argument("--cancel", action="store_true", help="discard a rebuild in progress and stop")
    p.add_argument("--accept-partial", action="store_true",
                   help="rebuild even though retention has removed events the projection applied: the new model "
                        "holds only what is still stored (without it, such a rebuild is refused, naming what is "
                        "missing)")
    p.add_argument("--keep-old", action="store_true",
                   help="keep the replaced tables in schema outbox_retired_<projection> (until the next rebuild)")

    p = sub.add_parser("replay", help="re-publish stored events of a topic (a time range, or one key) to Kafka")
    p.add_argument("--topic", type=topic_name, required=True, help="replay the events stored for this topic")
    for name in REPLAY_SETTINGS:
        add_setting_option(p, name, RelaySettings.model_fields[name])
    p.add_argument("--from-time", type=iso_time, default=None, metavar="ISO-8601",
                   help="events created at or after this time")
    p.add_argument("--to-time", type=iso_time, default=None, metavar="ISO-8601",
                   help="events created before this time")
    p.add_argument("--key", type=partition_key, default=None, help="only this partition key")
    p.add_argument("--to-topic", type=topic_name, default=None, help="produce to this topic instead of the events' own")
    p.add_argument("--upcasters", default=None, metavar="MODULE:ATTR",
                   help="an outbox_relay.upcast.Upcasters: payloads of older schema versions are sent in their "
                        "type's current shape")

    summary = "list sinks; drop a retired one (its progress, retries, dead letters), or recreate a dropped one"
    p = sub.add_parser("sinks", help=summary, description=describe_actions(summary, SINKS_ACTIONS))
    add_dsn_option(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (every action)")
    p.add_argument("action", choices=list(SINKS_ACTIONS), help="what to do (see actions above)")
    p.add_argument("name", nargs="?", default=None, help="the sink to drop or recreate")
    p.add_argument("--force", action="store_true",
                   help="drop a sink that relays still run or hold leases on: its pending events, parked events and "
                        "dead letters are lost, and a relay still running it stops")
    p.add_argument("--worker-ttl-seconds", type=seconds, default=None, metavar="SECONDS",
                   help="a relay heard from within this long still runs the sink (0.02-3600; default: the relays' "
                        f"setting from {env_var('worker_ttl_seconds')}, else 10)")

    summary = "how long history is kept, per retention class of topics (docs/history.md)"
    p = sub.add_parser("retention", help=summary, description=describe_actions(summary, RETENTION_ACTIONS))
    add_dsn_option(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (every action)")
    p.add_argument("action", choices=list(RETENTION_ACTIONS), help="what to do (see actions above)")
    p.add_argument("name", nargs="?", default=None, help="the class (class, drop-class) or topic (topic)")
    p.add_argument("--keep", type=retention_keep, default=None, metavar="DURATION",
                   help="class: how long its events are kept after delivery: seconds, or a number with s, m, h or d "
                        "(7d), or 'forever'; for the default class, 'relays' returns to the relays' "
                        f"--retention-seconds ({env_var('retention_seconds')})")
    p.add_argument("--class", dest="class_name", default=None, help="topic: the class to put it in")
    p.add_argument("--retention-seconds", type=retention_seconds, default=None, metavar="SECONDS",
                   help=f"the relays' --retention-seconds, for list and partitions (default: "
                        f"{env_var('retention_seconds')}, else 7 days)")

    summary = "list, retry or discard dead letters"
    p = sub.add_parser("dead-letters", help=summary, description=describe_actions(summary, DEAD_LETTERS_ACTIONS))
    add_dsn_option(p)
    p.add_argument("action", choices=list(DEAD_LETTERS_ACTIONS), help="what to do (see actions above)")
    p.add_argument("--sink", default=None, help="sink name (required for retry and discard)")
    p.add_argument("--key", default=None, help="only this partition key")
    p.add_argument("--event", dest="events", action="append", type=event_id, default=None,
                   help="only this event id (repeatable)")
    p.add_argument("--all", action="store_true", help="retry/discard every dead letter of the sink")
    p.add_argument("--limit", type=int_between(*DEAD_LETTERS_LIMIT), default=50,
                   help=f"list at most this many ({DEAD_LETTERS_LIMIT[0]}-{DEAD_LETTERS_LIMIT[1]})")
    p.add_argument("--after", type=event_id, default=None, metavar="EVENT_ID",
                   help="list: the next page, after this event's dead letter (the last one the previous page showed)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("keys", help="one partition key: why it waits, retry it now, skip its head, pause or "
                                    "resume it")
    actions = p.add_subparsers(dest="action", required=True)
    k = actions.add_parser("show", help="per sink: the key's bucket and owner, its parked head (attempts, next "
                                        "retry, last error), what waits behind it, dead letters, pause")
    add_key_arguments(k, sink_required=False)
    k.add_argument("--max-attempts", type=int_between(*MAX_ATTEMPTS), default=None, metavar="N",
                   help=f"the relays' --max-attempts, for 'attempt 3 of N' ({MAX_ATTEMPTS[0]}-{MAX_ATTEMPTS[1]}; "
                        f"default: {env_var('max_attempts')}, else "
                        f"{RelaySettings.model_fields['max_attempts'].default})")
    k = actions.add_parser("retry", help="make the key's parked head due now (its relay retries it at once)")
    add_key_arguments(k)
    k = actions.add_parser("skip", help="move the key's parked head to dead letters; the events behind it go on")
    add_key_arguments(k)
    k.add_argument("--event", type=event_id, default=None,
                   help="skip only if this event is the head (refused otherwise)")
    k = actions.add_parser("pause", help="hold the key's events for the sink (parked, in order) until resumed")
    add_key_arguments(k)
    k.add_argument("--reason", default=None, help="why (shown by keys show)")
    k = actions.add_parser("resume", help="let a paused key go: its held events are due at once")
    add_key_arguments(k)

    add_verify_parser(sub)  # `outbox-relay verify`: cli/verify.py

    p = sub.add_parser("dev", help="try it on this machine: start a private PostgreSQL and Kafka-protocol broker "
                                   "(the embedded extra), migrate, print the environment to export; Ctrl-C stops both")
    p.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                   help="keep the database in this directory between runs (default: a temporary one, removed at "
                        "exit)")
    p.add_argument("--topic", type=topic_name, default=DEFAULT_DEV_TOPIC, help="create this topic; exported as the "
                                                                           f"relays' {env_var('default_topic')}")
    p.add_argument("--partitions", type=int_between(1, 1000), default=3, help="the topic's partitions (1-1000)")
    p.add_argument("--kafka-port", type=int_between(1, 65535), default=None, metavar="PORT",
                   help="the broker's port on 127.0.0.1 (default: a free one)")
    console_cli.add_parser(sub)  # `outbox-relay console`: the operator console (outbox_relay/cli/console.py)
    inbox_cli.add_parser(sub)  # `outbox-relay inbox ...`: the consumer side (outbox_relay/inbox/cli.py)
    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "migrate": cmd_migrate,
    "grants": cmd_grants,
    "status": cmd_status,
    "lag": cmd_lag,
    "dead-letters": cmd_dead_letters,
    "retention": cmd_retention,
    "keys": cmd_keys,
    "sinks": cmd_sinks,
    "rebuild": cmd_rebuild,
    "replay": cmd_replay,
    "verify": cmd_verify,
    "dev": cmd_dev,
    "console": console_cli.cmd_console,
    "inbox": inbox_cli.command,
}


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that what is still buffered for a reader that went away is dropped
    at exit instead of reported ("Exception ignored ... BrokenPipeError", exit status 120)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (replaced in-process): nothing to redirect
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """The ``outbox-relay`` command; returns its exit status (EXIT_*)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    try:
        if args.command != "run":
            setup_logging(args.log_level, args.log_json, "-")
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # here, where a reader that went away is handled below, not at the interpreter's exit
        return code
    except BrokenPipeError:
        # stdout's reader stopped reading (`| head -1`): its choice, not a failure of the command.
        _discard_stdout()
        return EXIT_OK
    except OutboxError as exc:
        say_error(f"error: {exc}")
    except psycopg.OperationalError as exc:
        say_error(f"database error: {connection_problem(exc)}")
    except psycopg.Error as exc:
        say_error(f"database error: {type(exc).__name__}: {exc}")
    except KafkaException as exc:
        say_error(f"Kafka error: {exc}")
    except KeyboardInterrupt:  # Ctrl-C on a short command: nothing half done to report
        say_error("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.log_level == "debug":
            say(redact(traceback.format_exc()), file=sys.stderr, end="")
        say_error(f"unexpected error: {type(exc).__name__}: {exc}"
                  + ("" if args.log_level == "debug" else " (--log-level debug prints the traceback)"))
        return EXIT_INTERNAL
    return EXIT_ERROR
