"""``status``, ``lag``, ``dead-letters``, ``sinks``, ``keys`` and ``retention``: arguments to
``outbox_relay.admin`` calls, and what they return to text or JSON."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from typing import Any

import psycopg

from .. import admin
from ..admin import SKIPPED_ERROR
from ..errors import ConfigurationError
from .exit_codes import EXIT_OK
from .invocation import dsn_from_args, migrated_database, relays_retention_seconds, relays_setting
from .output import print_json, print_table, say, table_cell
from .values import MAX_ATTEMPTS, int_between, seconds

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


def cmd_status(args: argparse.Namespace) -> int:
    with migrated_database(dsn_from_args(args)) as conn:
        found = admin.status(conn, all_databases=args.all_databases, retention_seconds=relays_retention_seconds(args))
    titles = {
        "workers": "workers",
        "backlog": "backlog",
        "oldest_open_transaction": "oldest open writing transaction" + (" on the server" if args.all_databases
                                                                        else " in this database")
                                   + " (delays only its own events; holds back vacuum)",
        "dead_letters_by_key": "dead letters by key",
        "rebuilds": "rebuilds in progress",
        "retention": "history per retention class (partitions, size, oldest event, what holds its oldest partition "
                     "back; `outbox-relay retention list`)",
        "history": "history per projection: the topics it reads, from when they are stored (how far back a rebuild "
                   "goes); incomplete: retention removed events of them it applied (missing), so a full rebuild "
                   "needs --accept-partial",
    }
    tables: dict[str, admin.Table] = {f.name: getattr(found, f.name) for f in dataclasses.fields(found)}
    _print_sections(tables, args.json, titles)
    return EXIT_OK


def _print_sections(tables: dict[str, admin.Table], as_json: bool, titles: dict[str, str] | None = None) -> None:
    """Named tables: one JSON object of their records, or each table under its title (its name if none)."""
    if as_json:
        print_json({name: table.records() for name, table in tables.items()})
        return
    for name, table in tables.items():
        say(f"\n{(titles or {}).get(name, name)}:")
        print_table(table.rows, table.columns) if table.rows else say("  (none)")


def cmd_lag(args: argparse.Namespace) -> int:
    with migrated_database(dsn_from_args(args)) as conn:
        found = [dataclasses.asdict(b) for b in admin.backlog(conn, args.sink)]
    if args.json:
        print_json(found)
    else:
        print_table([list(b.values()) for b in found], list(found[0])) if found else say("no sinks")
    return EXIT_OK


def cmd_dead_letters(args: argparse.Namespace) -> int:
    if args.action != "list":
        if not args.sink:
            raise ConfigurationError(f"dead-letters {args.action} needs --sink")
        if not (args.events or args.key or args.all):
            raise ConfigurationError(f"dead-letters {args.action} needs --event, --key or --all")
    with migrated_database(dsn_from_args(args)) as conn:
        if args.action == "list":
            return _list_dead_letters(conn, args)
        change = admin.retry_dead_letters if args.action == "retry" else admin.discard_dead_letters
        result = change(conn, args.sink, event_ids=args.events, key=args.key, all=args.all)
    if args.json:
        print_json({"action": args.action, **dataclasses.asdict(result)})
        return EXIT_OK
    verb = "queued for retry" if args.action == "retry" else "discarded"
    say(f"{result.count} dead letters {verb}")
    return EXIT_OK


def _list_dead_letters(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    """One page, newest first; when there are more, the command for the next page (on stderr under --json)."""
    page = admin.dead_letters(conn, sink=args.sink, key=args.key, limit=args.limit, after=args.after)
    if args.json:
        print_json(page.records())
    else:
        print_table(page.rows, page.columns) if page.rows else say("no dead letters"
                                                                   + (" after that one" if args.after else ""))
    if page.more:
        following = ["outbox-relay", "dead-letters", "list"]
        following += [a for name in ("sink", "key") if getattr(args, name) for a in (f"--{name}", getattr(args, name))]
        following += ["--limit", str(args.limit), "--after", str(page.last_event_id)]
        say(f"more: {shlex.join(following)}", file=sys.stderr if args.json else None)
    return EXIT_OK


def cmd_sinks(args: argparse.Namespace) -> int:
    dsn = dsn_from_args(args)
    if args.action == "list":
        with migrated_database(dsn) as conn:
            table = admin.sinks(conn)
        if args.json:
            print_json(table.records())
        else:
            print_table(table.rows, table.columns) if table.rows else say("no sinks")
        return EXIT_OK
    if not args.name:
        raise ConfigurationError(f"sinks {args.action} needs the sink's name")
    with migrated_database(dsn) as conn:
        if args.action == "recreate":
            recreated = admin.recreate_sink(conn, args.name)
            result: dict[str, Any] = {"kind": recreated.kind, "recreated": True}
            lines = [f"sink {args.name!r} ({recreated.kind}) recreated: the next relay that runs it registers it "
                     "anew and delivers to it from the oldest retained event"]
        else:
            ttl = relays_setting(args, "worker_ttl_seconds", seconds, float)
            result, lines = _dropped(admin.drop_sink(conn, args.name, force=args.force, worker_ttl_seconds=ttl))
    if args.json:
        print_json({"action": args.action, "sink": args.name, **result})
    else:
        for line in lines:
            say(line)
    return EXIT_OK


def _dropped(drop: admin.SinkDrop) -> tuple[dict[str, Any], list[str]]:
    """What --json prints of a drop, and the lines a terminal gets."""
    name = drop.sink
    if not drop.dropped:
        return ({"kind": drop.kind, "dropped": False, "dropped_at": drop.dropped_at},
                [f"sink {name!r} was already dropped at {drop.dropped_at:%Y-%m-%d %H:%M:%S%z}"])
    cost = (f"{drop.pending_lost} pending event(s) never reach it, {drop.parked_deleted} parked event(s) and "
            f"{drop.dead_letters_deleted} dead letter(s) deleted")
    users = list(drop.in_use)
    lines = [f"dropped sink {name!r} ({drop.kind}): {cost}" + (f"; it was in use ({'; '.join(users)}): a relay still "
                                                               "running it stops" if users else "")]
    if drop.abandoned_rebuild_of is not None:
        lines.append(f"the rebuild of {drop.abandoned_rebuild_of!r} it belonged to is abandoned; its copies stay in "
                     f"schema {drop.retired_schema!r} until the next rebuild of it")
    lines.append(f"`outbox-relay sinks recreate {name}` lets a relay register it again, from the oldest retained "
                 "event")
    result = {"kind": drop.kind, "dropped": True, "pending_lost": drop.pending_lost,
              "parked_deleted": drop.parked_deleted, "dead_letters_deleted": drop.dead_letters_deleted,
              "in_use": users, "abandoned_rebuild_of": drop.abandoned_rebuild_of}
    return result, lines


def cmd_retention(args: argparse.Namespace) -> int:
    keep_default = relays_retention_seconds(args)
    with migrated_database(dsn_from_args(args)) as conn:
        if args.action in ("list", "partitions"):
            if args.action == "list":
                found = admin.retention(conn, keep_default)
                sections = {"classes": found.classes, "history": found.history}
            else:
                sections = {"partitions": admin.history_partitions(conn, keep_default)}
            _print_sections(sections, args.json)
            return EXIT_OK
        if args.action == "roll":
            rolled = admin.roll_history(conn)
            result: dict[str, Any] = {"action": "roll", "partition": rolled.partition}
            line = f"the partition being written ended; events now go to {rolled.partition}"
        elif not args.name:
            raise ConfigurationError(f"retention {args.action} needs a name")
        elif args.action == "class":
            if args.keep is None:
                raise ConfigurationError("retention class needs --keep (a duration, 'forever' or, for default, "
                                         "'relays')")
            changed = admin.set_retention_class(conn, args.name, None if args.keep == "forever" else args.keep)
            result = {"action": "class", "class": changed.name, "keep": args.keep}
            line = f"retention class {changed.name!r} keeps events " + (
                "as the relays' --retention-seconds says" if changed.follows_relays
                else "for good" if changed.keep_seconds is None else f"{changed.keep_seconds:g} seconds")
        elif args.action == "drop-class":
            admin.drop_retention_class(conn, args.name)
            result = {"action": "drop-class", "class": args.name}
            line = f"retention class {args.name!r} removed"
        else:
            if not args.class_name:
                raise ConfigurationError("retention topic needs --class (default: back to the default class)")
            mapped = admin.set_topic_retention(conn, args.name, args.class_name)
            result = {"action": "topic", "topic": mapped.topic, "class": mapped.class_name}
            line = (f"topic {mapped.topic!r} is in retention class {mapped.class_name!r} from the next partition on "
                    "(`outbox-relay retention roll` starts it now)")
    if args.json:
        print_json(result)
    else:
        say(line)
    return EXIT_OK


def cmd_keys(args: argparse.Namespace) -> int:
    key, sink = args.key, args.sink
    with migrated_database(dsn_from_args(args)) as conn:
        if args.action == "show":
            return _key_show(conn, args)
        if args.action == "pause":
            paused = admin.pause_key(conn, key, sink, reason=args.reason)
            if paused.already_paused:
                text = (f"key {key!r} was already paused for sink {sink!r} since {table_cell(paused.paused_at)} by "
                        f"{paused.paused_by}" + (f" ({table_cell(paused.reason)})" if paused.reason else "")
                        + ": nothing changed")
            else:
                text = (f"paused key {key!r} for sink {sink!r}: from the relay's next read on its events are held "
                        "(parked, in order) and none is retried; a batch already on its way still lands. "
                        f"`{admin.key_command('resume', key, sink)}` lets them go")
            return _key_done(args, {"action": "pause", **dataclasses.asdict(paused)}, text)
        if args.action == "resume":
            resumed = admin.resume_key(conn, key, sink)
            if not resumed.was_paused:
                return _key_done(args, {"action": "resume", "sink": sink, "key": key, "was_paused": False},
                                 f"key {key!r} is not paused for sink {sink!r}: nothing to resume")
            return _key_done(args, {"action": "resume", **dataclasses.asdict(resumed)},
                             f"resumed key {key!r} for sink {sink!r} (paused since "
                             f"{table_cell(resumed.paused_at)}): its {resumed.now_due} parked event(s) are due now, "
                             "in order")
        if args.action == "retry":
            retried = admin.retry_key(conn, key, sink)
            result = {"action": "retry", **dataclasses.asdict(retried)}
            behind = result.pop("parked") - 1
            result["paused"] = False
            return _key_done(args, result,
                             f"event {retried.event_id} ({retried.type}), the head of key {key!r}, is due now for "
                             f"sink {sink!r}: its relay retries it at once, then the {behind} event(s) behind it")
        skipped = admin.skip_key(conn, key, sink, event_id=args.event)
        text = (f"event {skipped.event_id} ({skipped.type}, {skipped.attempts} failed attempt(s)) of key {key!r} "
                f"moved to sink {sink!r}'s dead letters ('{SKIPPED_ERROR}'); "
                + (f"the key stays paused: its {skipped.now_due} other parked event(s) are held until "
                   f"`{admin.key_command('resume', key, sink)}`" if skipped.paused else
                   f"the {skipped.now_due} event(s) behind it are due now"))
        return _key_done(args, {"action": "skip", **dataclasses.asdict(skipped)}, text)


def _key_show(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    max_attempts = relays_setting(args, "max_attempts", int_between(*MAX_ATTEMPTS), int)
    state = admin.key_state(conn, args.key, sink=args.sink, max_attempts=max_attempts)
    if not state.sinks:
        if args.json:
            print_json(dataclasses.asdict(state))
        else:
            say("no sinks (no relay has run against this database yet)")
        return EXIT_OK
    report = dataclasses.asdict(state)
    if args.json:
        print_json(report)
        return EXIT_OK
    say(f"key {args.key!r} (bucket {state.bucket})")
    for r in report["sinks"]:
        say(f"  {r['sink']}: {r['summary']}")
    for r in report["sinks"]:
        _print_key_report(r)
    return EXIT_OK


def _print_key_report(r: dict[str, Any]) -> None:
    say(f"\nsink {r['sink']} ({r['kind']}): {r['state']}")
    if r["owner"]:
        say(f"  bucket {r['bucket']}: held by {r['owner']} (fence {r['fence']}, lease {r['lease_seconds_left']} s "
             "left)")
    else:
        say(f"  bucket {r['bucket']}: held by no relay")
    if r["paused"] is not None:
        p = r["paused"]
        say(f"  paused since {table_cell(p['since'])} by {p['by']} (role {p['role']})"
             + (f": {table_cell(p['reason'])}" if p["reason"] else ""))
    head = r["head"]
    if head is None:
        say("  parked: nothing")
    else:
        wait = head["retry_in_seconds"]
        when = ("when resumed" if r["paused"] is not None else
                f"{table_cell(head['next_retry'])} (in {wait:.0f} s)" if wait is not None and wait > 0 else "due now")
        say(f"  parked head: event {head['event_id']} ({table_cell(head['type'])}), {head['attempts']} failed "
            f"attempt(s), parked since {table_cell(head['parked_at'])}, next retry {when}")
        if head["last_error"] is not None:
            say(f"    last error: {table_cell(head['last_error'])}")
        say(f"  queued behind it: {r['queued_behind']} event(s)")
    say(f"  not read by the sink yet: {r['unread']} event(s)"
         + (f", the oldest stored {table_cell(r['oldest_unread'])}" if r["oldest_unread"] else ""))
    dead = r["dead_letters"]
    say(f"  dead letters: {dead['count']}" + (f" (newest {len(dead['recent'])}):" if dead["count"] else ""))
    for d in dead["recent"]:
        say(f"    {d['event_id']} ({table_cell(d['type'])}) after {d['attempts']} attempt(s) at "
            f"{table_cell(d['dead_at'])}: {table_cell(d['last_error'])}")


def _key_done(args: argparse.Namespace, result: dict[str, Any], text: str) -> int:
    if args.json:
        print_json(result)
    else:
        say(text)
    return EXIT_OK
