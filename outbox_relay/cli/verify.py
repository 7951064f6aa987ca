"""``verify``: arguments to ``outbox_relay.verify.verify``, and its report as text or JSON."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..settings import RelaySettings
from ..verify import Report, verify
from .exit_codes import EXIT_FAILED, EXIT_OK
from .invocation import migrated_database, settings_from_args
from .output import print_json, print_table, say
from .parsers import add_setting_option
from .values import int_between, seconds, topic_name

# What `verify` reads of the relay settings: how to reach the broker and how the sink shaped its messages
# (a broker sink's own settings come from their OUTBOX_* variables).
VERIFY_SETTINGS = ("dsn", "kafka_bootstrap_servers", "kafka_config", "kafka_config_file", "kafka_format",
                   "kafka_debezium_topic", "kafka_debezium_route_by", "default_topic")
SAMPLE_LIMIT = (1, 1000)


def add_parser(sub: Any) -> None:  # the subparsers of build_parser (argparse keeps their type private)
    p = sub.add_parser("verify", help="read back what reached a sink and check it against the stored history per "
                                      "key: lost, reordered, phantoms, duplicates (exit 1 on loss, reorder or "
                                      "phantom)")
    # Not "sink": that is the relay setting --sink MODULE:ATTR, which settings_from_args would read.
    p.add_argument("--sink", dest="sink_name", required=True,
                   help="the sink to verify (a Kafka sink, a projection, a broker sink)")
    for name in VERIFY_SETTINGS:
        add_setting_option(p, name, RelaySettings.model_fields[name])
    p.add_argument("--topic", dest="topics", action="append", type=topic_name, default=None,
                   help="check only the events of this topic (repeatable; default: every topic the sink reads)")
    p.add_argument("--timeout-seconds", type=seconds, default=5.0, metavar="SECONDS",
                   help="reading back ends after this long without a message")
    p.add_argument("--limit", type=int_between(*SAMPLE_LIMIT), default=10,
                   help=f"name at most this many offending keys and phantoms ({SAMPLE_LIMIT[0]}-{SAMPLE_LIMIT[1]})")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_verify(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    with migrated_database(settings.dsn.get_secret_value()) as conn:
        report = verify(conn, args.sink_name, settings, topics=args.topics, timeout_seconds=args.timeout_seconds,
                        sample=args.limit)
    if args.json:
        print_json({"ok": report.ok, **dataclasses.asdict(report)})
    else:
        _print_report(report)
    return EXIT_OK if report.ok else EXIT_FAILED


def _print_report(r: Report) -> None:
    say(f"sink {r.sink} ({r.kind}): {r.checks}")
    say(f"stored: {r.stored} events of its topics: {r.delivered} delivered, {r.pending} not yet delivered, "
         f"{r.dead_lettered} dead-lettered"
         + (f"; {r.removed_by_retention} removed by retention (through {r.removed_through}), not checkable"
            if r.removed_by_retention else ""))
    say(f"read back: {r.received} messages, {r.distinct} events ({r.duplicates} duplicates, allowed)"
         + (f"; {r.dead_read_back} dead-lettered events among them" if r.dead_read_back else ""))
    verdict = "OK" if r.ok else "FAILED"
    say(f"{verdict}: lost {r.lost}, reordered {r.reordered}, phantoms {r.phantoms}"
         + (f" (and {r.overlapping} inversions of transactions that may have overlapped, allowed)"
            if r.overlapping else ""))
    if r.lost_keys:
        say(f"\nlost, by key (the first {len(r.lost_keys)}):")
        print_table([(k.key, k.count, [str(i) for i in k.event_ids]) for k in r.lost_keys],
                     ("key", "lost", "event ids"))
    if r.reordered_keys:
        say(f"\nreordered, by key (the first {len(r.reordered_keys)}):")
        print_table([(k.key, k.destination, k.count, str(k.came_first), str(k.came_after)) for k in r.reordered_keys],
                     ("key", "destination", "out of order", "came first", "came after it, published before"))
    if r.phantom_events:
        say(f"\nphantoms (the first {len(r.phantom_events)}):")
        print_table([(str(p.id), p.key, p.destination, p.reason) for p in r.phantom_events],
                     ("event id", "key", "destination", "why"))
    for note in r.notes:
        say(f"\nnote: {note}")
