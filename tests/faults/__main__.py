"""``python -m tests.faults --seconds 120 --faults 50 [--relays 4] [--seed N] [--report bench/results/DATE-faults.md]``

Exit code 0 only if the checker passed (no loss, no phantoms, per-key order, relays drained and
exited cleanly); 1 if it did not; 2 if the run itself could not be done.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path

from tests.faults import faults
from tests.faults.cluster import set_lease_seconds
from tests.faults.faults import DEFAULT_KINDS
from tests.faults.run import Config, run


def parse(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(
        prog="python -m tests.faults",
        description="Fault injection against real outbox-relay processes, PostgreSQL and a Kafka-protocol broker: "
                    "checks no loss, no phantoms and per-key order, and measures duplicates and recovery per fault.")
    parser.add_argument("--seconds", type=float, default=120.0,
                        help="planned length of the fault phase; faults are spread over it (default 120)")
    parser.add_argument("--faults", type=int, default=50, help="number of faults (default 50)")
    parser.add_argument("--relays", type=int, default=4, help="relay processes (default 4)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a random one, printed)")
    parser.add_argument("--report", type=Path, default=None, help="write the markdown report here (also printed)")
    parser.add_argument("--json", type=Path, default=None, dest="json_path",
                        help="also write a machine-readable summary here")
    parser.add_argument("--sabotage-lose", type=int, default=0, metavar="N", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=300.0, help="events/s over all producers (default 300)")
    parser.add_argument("--keys", type=int, default=600, help="partition keys (default 600)")
    parser.add_argument("--producers", type=int, default=2, help="producer processes (default 2)")
    parser.add_argument("--producer-threads", type=int, default=4, help="threads per producer process (default 4)")
    parser.add_argument("--threshold", type=float, default=1.0,
                        help="an event consumed more than this many seconds after its commit is late (default 1)")
    parser.add_argument("--max-wait", type=float, default=30.0,
                        help="longest wait for delivery to recover before the next fault (default 30)")
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                        help=f"comma-separated fault kinds (default: {','.join(DEFAULT_KINDS)}; relay_starve "
                             "only through --starve)")
    parser.add_argument("--starve", type=int, default=0, metavar="N",
                        help="add N relay_starve faults, spread evenly: every relay runs --starve-duty of the time "
                             "for --starve-seconds while the other faults go on (default 0)")
    parser.add_argument("--starve-seconds", type=float, default=faults.STARVE_SECONDS,
                        help=f"length of one starvation (default {faults.STARVE_SECONDS:g})")
    parser.add_argument("--starve-duty", type=float, default=faults.STARVE_DUTY,
                        help=f"fraction of the time a starved relay runs (default {faults.STARVE_DUTY:g})")
    parser.add_argument("--dsn", default=os.environ.get("OUTBOX_TEST_DSN"),
                        help="use this PostgreSQL (a superuser or CREATEDB role) instead of an embedded one; "
                             "no database restarts then [env OUTBOX_TEST_DSN]")
    parser.add_argument("--relay-option", action="append", default=[], metavar="ARG",
                        help="extra argument for every `outbox-relay run`, e.g. --relay-option=--kafka-stall-seconds=5")
    parser.add_argument("--workdir", type=Path, default=None, help="logs go here (default: a new temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the test database at the end")
    parser.add_argument("--lease-seconds", type=float, default=None,
                        help="the relays' --lease-seconds, also the length the lease-outlasting faults aim past "
                             "(default 3)")
    parser.add_argument("--cpu-hogs", type=int, default=0, metavar="N",
                        help="N busy-looping processes for the whole run: CPU contention, as on a shared or "
                             "overcommitted host, so relays miss renewals and lose leases (default 0)")
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in DEFAULT_KINDS]
    if unknown:
        parser.error(f"unknown fault kinds {unknown}; known: {', '.join(DEFAULT_KINDS)} (relay_starve: --starve)")
    if args.starve < 0 or args.starve_seconds <= 0 or not 0.0 < args.starve_duty <= 1.0:
        parser.error("--starve must be >= 0, --starve-seconds positive and --starve-duty in (0, 1]")
    faults.STARVE_SECONDS, faults.STARVE_DUTY = args.starve_seconds, args.starve_duty
    if args.faults < 1 or args.seconds <= 0 or args.relays < 1 or args.rate <= 0:
        parser.error("--faults, --seconds, --relays and --rate must be positive")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 1_000_000)
    command = ["python", "-m", "tests.faults", *(argv if argv is not None else sys.argv[1:])]
    if args.seed is None:
        command += ["--seed", str(seed)]
    global CPU_HOGS
    CPU_HOGS = max(0, args.cpu_hogs)
    if args.lease_seconds is not None:
        if args.lease_seconds <= 0:
            parser.error("--lease-seconds must be positive")
        set_lease_seconds(args.lease_seconds)
    return Config(seconds=args.seconds, faults=args.faults, relays=args.relays, seed=seed, report=args.report,
                  json_path=args.json_path, sabotage_lose=args.sabotage_lose,
                  rate=args.rate, keys=args.keys, producers=args.producers, producer_threads=args.producer_threads,
                  threshold=args.threshold, max_wait=args.max_wait, kinds=kinds, starve=args.starve, dsn=args.dsn,
                  workdir=args.workdir, keep=args.keep, relay_options=args.relay_option,
                  command=shlex.join(command))


CPU_HOGS = 0  # set by parse()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level="WARNING", stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    config = parse(argv)
    print(f"[faults] {config.command}", file=sys.stderr, flush=True)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(CPU_HOGS)]
    try:
        outcome = run(config)
    except Exception as exc:
        logging.getLogger("tests.faults").exception("the run could not be done: %s", exc)
        return 2
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(outcome.report)
    if config.report is not None:
        print(f"[faults] report written to {config.report}", file=sys.stderr)
    print(f"[faults] {'PASSED' if outcome.passed else 'FAILED'}; logs in {outcome.workdir}", file=sys.stderr)
    return 0 if outcome.passed else 1


if __name__ == "__main__":
    sys.exit(main())
