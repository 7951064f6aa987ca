"""The faults, injected from outside the relays, and the schedule that spaces them.

Every injector returns ``(target, detail)`` once its action is over (a SIGSTOP lasts until the
SIGCONT, a database restart until the server is back). Durations and targets come from the run's
seeded ``random.Random``, so a seed replays the same sequence of faults.

| kind | what happens |
|---|---|
| relay_kill | SIGKILL one relay; a new process (new worker id) starts 0-2 s later |
| relay_stop | SIGSTOP one relay for lease + 1..3 s (its leases expire, others take over), then SIGCONT |
| relay_term | SIGTERM one relay (graceful drain), wait for its exit, start a new one: a deploy |
| broker_restart | hold the relays' broker traffic at the proxy, record the whole topic, SIGKILL Tansu, |
|  | keep it down 0-3 s, start it (empty), create the topic again; half the time twice in a row |
| db_restart | stop PostgreSQL (fast or immediate, i.e. a crash) for 1-4 s, start it (embedded only) |
| db_cut | abort every connection between one relay (or all) and PostgreSQL at its proxy |
| db_stall | stop forwarding between one relay (or all) and PostgreSQL for 1 s .. lease + 2 s |
| kafka_cut | abort every relay connection to the broker at the proxy |
| kafka_stall | stop forwarding relay <-> broker for 1-5 s |
| backend_kill | pg_terminate_backend of every relay backend (application_name outbox-relay...) |
| relay_starve | every relay runs only `STARVE_DUTY` of the time (SIGSTOP/SIGCONT in 100-200 ms periods) for |
|  | `STARVE_SECONDS`, in the background: the next faults are injected meanwhile (tests/faults/starve.py) |

relay_starve is not among the default kinds (one lasts 30 s; `--starve N` adds N of them to the plan).
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from tests.faults import cluster
from tests.faults.cluster import (
    DRAIN_SECONDS,
    Broker,
    Database,
    Fleet,
    create_topic,
    owned_buckets,
    terminate_relay_backends,
)
from tests.faults.proxy import Proxy
from tests.faults.recorder import Recorder
from tests.faults.starve import Starver

log = logging.getLogger("tests.faults")

# Requests already past the proxy when it stalls reach the broker within this time.
IN_FLIGHT_SETTLE = 0.3
# relay_starve: the fraction of the time the relays run, and for how long (``--starve-duty``, ``--starve-seconds``).
STARVE_DUTY = 0.25
STARVE_SECONDS = 30.0


@dataclass
class Lab:
    """Everything an injector may touch."""

    rnd: random.Random
    database: Database
    broker: Broker
    kafka_proxy: Proxy
    db_proxies: list[Proxy]  # per relay slot
    fleet: Fleet
    recorder: Recorder
    topic: str
    partitions: int
    findings: list[str] = field(default_factory=list)  # misbehaviour seen while injecting (fails the run)
    # Signals that stop or continue relays are sent under this lock; slots a relay_stop holds stopped are
    # in ``paused``, which a starvation running meanwhile leaves alone.
    signals: threading.Lock = field(default_factory=threading.Lock)
    paused: set[int] = field(default_factory=set)
    starving: list[Starver] = field(default_factory=list)
    # Set by an injector whose fault goes on after it returns (relay_starve): when it ends (epoch seconds).
    ends_at: float | None = None

    def pick_slot(self) -> tuple[int, int]:
        """A relay that holds buckets (a fault on an idle relay tests nothing), and how many it holds."""
        try:
            with self.database.connect() as conn:
                owned = owned_buckets(conn)
        except psycopg.Error:
            owned = {}
        holding = sorted(slot for slot, r in self.fleet.relays.items() if owned.get(r.worker_id))
        slot = self.rnd.choice(holding or sorted(self.fleet.relays))
        return slot, owned.get(self.fleet.relays[slot].worker_id, 0)


Injector = Callable[[Lab], tuple[str, str]]


def relay_kill(lab: Lab) -> tuple[str, str]:
    slot, held = lab.pick_slot()
    old = lab.fleet.signal(slot, signal.SIGKILL)
    lab.fleet.wait_exit(slot, 10)
    down = lab.rnd.uniform(0.0, 2.0)
    time.sleep(down)
    new = lab.fleet.start(slot)
    return old.worker_id, f"SIGKILL (it held {held} buckets); {new.worker_id} started {down:.1f}s later"


def relay_stop(lab: Lab) -> tuple[str, str]:
    slot, held = lab.pick_slot()
    pause = cluster.LEASE_SECONDS + lab.rnd.uniform(1.0, 3.0)
    with lab.signals:
        lab.paused.add(slot)
        relay = lab.fleet.signal(slot, signal.SIGSTOP)
    time.sleep(pause)
    with lab.signals:
        lab.fleet.signal(slot, signal.SIGCONT)
        lab.paused.discard(slot)
    return relay.worker_id, (f"SIGSTOP for {pause:.1f}s (lease {cluster.LEASE_SECONDS:g}s; it held {held} buckets), "
                             "SIGCONT")


def relay_term(lab: Lab) -> tuple[str, str]:
    slot, held = lab.pick_slot()
    started = time.monotonic()
    old = lab.fleet.signal(slot, signal.SIGTERM)
    code = lab.fleet.wait_exit(slot, DRAIN_SECONDS + 10)
    took = time.monotonic() - started
    if code is None:  # the drain deadline should have stopped it: a finding, in the detail
        lab.fleet.signal(slot, signal.SIGKILL)
        lab.fleet.wait_exit(slot, 10)
    new = lab.fleet.start(slot)
    exit_text = "did not exit (SIGKILLed)" if code is None else f"exit {code}"
    if code != 0:
        lab.findings.append(f"relay {old.worker_id} did not drain cleanly on SIGTERM: {exit_text} after {took:.1f}s")
    return old.worker_id, f"SIGTERM (it held {held} buckets): {exit_text} after {took:.1f}s; {new.worker_id} started"


def broker_restart(lab: Lab) -> tuple[str, str]:
    """Once, or (half the time) twice in a row 0.5-2 s apart, as a crash-looping broker does."""
    times = lab.rnd.choice([1, 2])
    details = []
    for i in range(times):
        if i:
            gap = lab.rnd.uniform(0.5, 2.0)
            time.sleep(gap)
            details.append(f"again {gap:.1f}s later:")
        details.append(_restart_broker(lab, down=lab.rnd.uniform(0.0, 3.0)))
    return "tansu", " ".join(details)


def _restart_broker(lab: Lab, down: float) -> str:
    # Tansu keeps messages in memory only: record all it acknowledged before it forgets them.
    # Holding the relays' traffic at the proxy freezes what is on the topic without pausing the
    # relays (their leases live in PostgreSQL and stay renewed).
    started = time.monotonic()
    lab.kafka_proxy.stall()
    time.sleep(IN_FLIGHT_SETTLE)
    found = lab.recorder.drain(quiet=0.5, timeout=30)
    held = time.monotonic() - started
    lab.broker.kill()
    lab.recorder.end_incarnation()
    lab.kafka_proxy.resume()  # the relays meet a broker that is down: refused connections
    time.sleep(down)
    # Held again while it comes back, until the topic exists: a relay's first produce would
    # otherwise auto-create it with the broker's default partition count.
    lab.kafka_proxy.stall()
    lab.broker.start()
    create_topic(lab.kafka_proxy.address, lab.topic, lab.partitions)
    lab.recorder.begin_incarnation()
    lab.kafka_proxy.resume()
    return (f"traffic held {held:.1f}s while the topic was read (re-read found {found}), SIGKILL, "
            f"down {down:.1f}s, back empty")


def db_restart(lab: Lab) -> tuple[str, str]:
    mode = lab.rnd.choice(["fast", "immediate"])
    down = lab.rnd.uniform(1.0, 4.0)
    started = time.monotonic()
    lab.database.stop(mode)
    time.sleep(down)
    lab.database.start()
    return "postgresql", f"stop -m {mode}, down {down:.1f}s, back after {time.monotonic() - started:.1f}s"


def _proxies(lab: Lab) -> tuple[str, list[Proxy]]:
    if lab.rnd.random() < 0.5:
        slot, _ = lab.pick_slot()
        return lab.fleet.relays[slot].worker_id, [lab.db_proxies[slot]]
    return "all relays", list(lab.db_proxies)


def db_cut(lab: Lab) -> tuple[str, str]:
    target, proxies = _proxies(lab)
    n = sum(p.cut() for p in proxies)
    return target, f"{n} connections to PostgreSQL aborted"


def db_stall(lab: Lab) -> tuple[str, str]:
    target, proxies = _proxies(lab)
    pause = lab.rnd.uniform(1.0, cluster.LEASE_SECONDS + 2.0)
    for p in proxies:
        p.stall()
    time.sleep(pause)
    for p in proxies:
        p.resume()
    return target, f"PostgreSQL traffic stalled {pause:.1f}s (lease {cluster.LEASE_SECONDS:g}s)"


def kafka_cut(lab: Lab) -> tuple[str, str]:
    return "all relays", f"{lab.kafka_proxy.cut()} broker connections aborted"


def kafka_stall(lab: Lab) -> tuple[str, str]:
    pause = lab.rnd.uniform(1.0, 5.0)
    lab.kafka_proxy.stall()
    time.sleep(pause)
    lab.kafka_proxy.resume()
    return "all relays", f"broker traffic stalled {pause:.1f}s"


def backend_kill(lab: Lab) -> tuple[str, str]:
    with lab.database.connect() as conn:
        names = terminate_relay_backends(conn)
    return "all relays", f"pg_terminate_backend of {len(names)} relay backends"


def relay_starve(lab: Lab) -> tuple[str, str]:
    """Starts the starvation and returns: it goes on in the background until ``lab.ends_at``."""
    starver = Starver(lab.fleet, random.Random(lab.rnd.random()), lab.signals, lab.paused, STARVE_SECONDS,
                      STARVE_DUTY).start()
    lab.starving.append(starver)
    lab.ends_at = starver.ends_at
    return "all relays", (f"{STARVE_DUTY:.0%} of the time for {STARVE_SECONDS:g}s (SIGSTOP/SIGCONT every "
                          "100-200 ms), other faults go on")


INJECTORS: dict[str, Injector] = {
    "relay_kill": relay_kill,
    "relay_stop": relay_stop,
    "relay_term": relay_term,
    "broker_restart": broker_restart,
    "db_restart": db_restart,
    "db_cut": db_cut,
    "db_stall": db_stall,
    "kafka_cut": kafka_cut,
    "kafka_stall": kafka_stall,
    "backend_kill": backend_kill,
    "relay_starve": relay_starve,
}
DEFAULT_KINDS = [k for k in INJECTORS if k != "relay_starve"]
NEEDS_RESTARTABLE_DB = {"db_restart"}


def plan(kinds: list[str], count: int, rnd: random.Random, starve: int = 0) -> list[str]:
    """``count`` faults, the kinds as evenly as possible, in a seeded random order; with ``starve``, that
    many relay_starve faults inserted too, spread evenly (the others keep the order the seed gives them)."""
    order = [kinds[i % len(kinds)] for i in range(count)]
    rnd.shuffle(order)
    for j in reversed(range(starve)):
        order.insert((2 * j + 1) * count // (2 * starve), "relay_starve")
    return order
