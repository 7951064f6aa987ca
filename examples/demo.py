"""The whole path on embedded servers: producer -> outbox -> two relays -> Kafka and a read model.

    python examples/demo.py          # or: bash scripts/demo.sh (creates .venv and installs first)

1. Starts a private PostgreSQL 18 and a Tansu broker (both from wheels), creates the topic.
2. Runs `outbox-relay migrate`, then starts TWO `outbox-relay run` processes; they split the
   256 buckets of each sink (Kafka, and the projection `customer_orders` of
   examples/demo_projection.py) between them through the database alone.
3. A producer places and pays orders; each event is published in the transaction that writes the
   order row (examples/order_service.py). One order is of a customer the read model does not know
   yet: its handler rejects it, and past --max-attempts it is dead-lettered (a poison event; the
   other keys go on).
4. SIGKILL to relay-a: relay-b takes its buckets over (the moment is printed, with the bound that
   --worker-ttl-seconds and --heartbeat-seconds give), and delivers the orders placed after the kill.
5. The fix (the customer is loaded), then `outbox-relay dead-letters retry`: the read model applies
   the order.
6. A consumer (assign() on every partition, no consumer group) prints each message as it arrives
   and checks that every order's events arrived in publish order.
7. Prints `outbox-relay status` and the interesting lines of relay-b's /metrics (each relay runs
   with --metrics-port), then sends SIGTERM to relay-b: it drains and exits 0.

Exit status 0 when every event arrived once or more, in order per key, the poison event was
dead-lettered and then applied by the retry, relay-b took every bucket over, its /metrics could be
read, and it exited 0.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from decimal import Decimal
from pathlib import Path
from typing import IO, Any

import psycopg
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))  # order_service, next to this file

import demo_projection
from order_service import create_schema, pay_order, place_order

from outbox_relay.private_servers import EmbeddedKafka, EmbeddedPostgres

TOPIC = "orders"
PARTITIONS = 3
ORDERS = 20  # placed and paid; the first half before relay-a is killed, the rest after
KILLED_AFTER = 12
POISON_ORDER = 99  # placed for a customer the read model does not know yet
POISON_CUSTOMER = "customer-new"
PROJECTION = "customer_orders"  # examples/demo_projection.py; also the sink's name
RELAYS = ("relay-a", "relay-b")
HEARTBEAT_SECONDS, WORKER_TTL_SECONDS = 0.5, 2.0
# Short intervals so that the demo moves quickly; production defaults are in `outbox-relay run --help`.
RELAY_OPTIONS = ["--default-topic", TOPIC, "--heartbeat-seconds", str(HEARTBEAT_SECONDS),
                 "--worker-ttl-seconds", str(WORKER_TTL_SECONDS), "--lease-seconds", "6", "--poll-seconds", "0.5",
                 "--housekeeping-seconds", "1", "--drain-seconds", "10", "--metrics-host", "127.0.0.1",
                 "--metrics-refresh-seconds", "1", "--projections", "demo_projection", "--projection", PROJECTION,
                 "--max-attempts", "3", "--backoff-base-seconds", "0.2", "--backoff-max-seconds", "0.5"]
# What a relay logs that is worth showing here (everything at warning level and above is shown too).
INTERESTING = ("started", "acquired", "released", "draining", "stopped", "dead-lettered")

_print_lock = threading.Lock()


def say(text: str) -> None:
    with _print_lock:
        print(text, flush=True)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "outbox_relay.cli", *args]


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout:.0f}s")
        time.sleep(interval)


# -- relays -----------------------------------------------------------------------------------


class Relay:
    """One `outbox-relay run` process; its JSON log lines are summarised on our stdout."""

    def __init__(self, name: str, env: dict[str, str], bootstrap: str) -> None:
        self.name = name
        self.metrics_port = free_port()
        self.proc = subprocess.Popen(
            cli("--log-json", "run", "--worker-id", name, "--kafka-bootstrap-servers", bootstrap,
                "--metrics-port", str(self.metrics_port), *RELAY_OPTIONS),
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        self.started = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(self.proc.stderr,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[bytes] | None) -> None:
        assert stream is not None
        for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            try:
                entry = json.loads(line)
            except ValueError:  # not a log line (a crash trace, librdkafka's own output)
                say(f"  [{self.name}] {line}")
                continue
            message = str(entry.get("message", ""))
            if "started" in message:
                self.started.set()
            if entry.get("level") not in ("debug", "info") or any(w in message for w in INTERESTING):
                say(f"  [{self.name}] {entry.get('level')}: {message}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            say(f"  [{self.name}] did not exit within {timeout:.0f}s: killing it")
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(2)
        return code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- metrics ------------------------------------------------------------------------------------

# The lines of a scrape worth showing here; the rest (buckets, _created, lease changes, ...) is for
# Prometheus (docs/observability.md lists every metric).
SHOWN = ("outbox_relay_events_delivered_total", "outbox_relay_events_dead_lettered_total",
         "outbox_relay_delivery_latency_seconds_count", "outbox_relay_pending_events",
         "outbox_relay_oldest_pending_age_seconds", "outbox_relay_dead_letters", "outbox_relay_buckets_held",
         "outbox_relay_listening")


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:  # /readyz answers 503 with its reasons
        return err.code, err.read().decode()


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The upper bound of the histogram bucket that holds the q-quantile (cumulative buckets)."""
    total = buckets[-1][1]
    return next(le for le, count in buckets if count >= q * total)


def show_metrics(relay: Relay) -> bool:
    """Print the interesting lines of one relay's /metrics; False if it can not be read."""
    port = relay.metrics_port
    say(f"\n$ curl -s http://127.0.0.1:{port}/metrics    ({relay.name}; the interesting lines)")
    try:
        # The backlog gauges are read from the database every --metrics-refresh-seconds: wait for a
        # refresh that has seen the deliveries.
        text = ""

        def refreshed() -> bool:
            nonlocal text
            text = get(port, "/metrics")[1]
            return 'outbox_relay_pending_events{sink="kafka"} 0.0' in text

        try:
            wait_for(refreshed, 10, "the backlog gauges to show nothing pending", interval=0.5)
        except TimeoutError as exc:
            say(f"  ({exc}; showing the last scrape)")
        buckets: list[tuple[float, float]] = []
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "outbox_relay_delivery_latency_seconds_bucket":
                    buckets.append((float(sample.labels["le"]), sample.value))
        for line in text.splitlines():
            if line.startswith(SHOWN):
                say(f"  {line}")
        if buckets and buckets[-1][1] > 0:
            say(f"  delivery latency, from the histogram: p50 <= {quantile(buckets, 0.5):g} s, "
                f"p99 <= {quantile(buckets, 0.99):g} s (bucket bounds; the dashboard interpolates)")
        status, body = get(port, "/readyz")
        say(f"\n$ curl -s http://127.0.0.1:{port}/readyz\n  {status} {body.strip()}")
        return status == 200 and "outbox_relay_events_delivered_total" in text
    except OSError as exc:
        say(f"  could not read the relay's metrics: {exc}")
        return False


# -- consumer ---------------------------------------------------------------------------------


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


class Printer:
    """Reads every partition of the topic from the beginning (assign(), no group) and prints."""

    def __init__(self, bootstrap: str, partitions: list[int]) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        self.consumer = Consumer({
            "bootstrap.servers": bootstrap,
            "group.id": "outbox-demo",  # required by the client; assign() never joins the group
            "enable.auto.commit": False,
            "enable.partition.eof": False,
        })
        self.consumer.assign([TopicPartition(TOPIC, p, OFFSET_BEGINNING) for p in partitions])
        self.seen: dict[str, list[tuple[str, str]]] = defaultdict(list)  # key -> [(ce_id, type)]
        self.ids: set[str] = set()
        self.messages = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="consumer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            msg = self.consumer.poll(0.2)
            if msg is None:
                continue
            if msg.error():
                say(f"  consumer: {msg.error()}")
                continue
            raw = msg.headers() or []  # a consumer gets a list of (name, value)
            headers = {k: _text(v) for k, v in (raw.items() if isinstance(raw, dict) else raw)}
            key = _text(msg.key())
            ce_type, ce_id = headers.get("ce_type", "?"), headers.get("ce_id", "?")
            self.messages += 1
            duplicate = ce_id in self.ids
            self.ids.add(ce_id)
            if not duplicate:
                self.seen[key].append((ce_id, ce_type))
            say(f"  consumed  partition {msg.partition()}  {key:<9} {ce_type:<12} {_text(msg.value())}"
                + ("  (duplicate, ignored)" if duplicate else ""))
        self.consumer.close()


# -- producer ---------------------------------------------------------------------------------


def produce(dsn: str, orders: range, rng: random.Random) -> list[tuple[str, str]]:
    """Place and pay these orders in shuffled interleaving; returns (key, type) in publish order."""
    pending = list(orders)
    published: list[tuple[str, str]] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        placed: list[int] = []
        while pending or placed:
            # Pay a placed order or place a new one, at random: keys interleave, per-key order is fixed.
            if placed and (not pending or rng.random() < 0.5):
                order_id = placed.pop(rng.randrange(len(placed)))
                result = pay_order(conn, order_id, payment_id=f"pay-{order_id}")
                published.append((f"order:{order_id}", "OrderPaid"))
                verb = "paid  "
            else:
                order_id = pending.pop(0)
                result = place_order(conn, order_id, customer=f"customer-{order_id % 7}",
                                     amount=Decimal(10 + order_id) + Decimal("0.99"))
                placed.append(order_id)
                published.append((f"order:{order_id}", "OrderPlaced"))
                verb = "placed"
            say(f"  produced  order:{order_id:<3} {verb} (event {str(result.id)[:8]}..., created={result.created})")
            time.sleep(0.02)
    return published


def run_cli(env: dict[str, str], *args: str) -> int:
    """Show and run one short `outbox-relay` command."""
    say(f"\n$ outbox-relay {' '.join(args)}")
    # Warnings and up only: the command's own report (and the database it used) is what is worth showing.
    # Without COLUMNS the tables keep their full values (the last error of a dead letter is the point here).
    env = {k: v for k, v in env.items() if k != "COLUMNS"}
    out = subprocess.run(cli("--log-level", "warning", *args), env=env, capture_output=True, text=True, check=False)
    say("\n".join("  " + line for line in (out.stdout + out.stderr).strip().splitlines()))
    return out.returncode


def owners(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Buckets held per relay, over both sinks (256 each)."""
    rows = conn.execute("SELECT owner, count(*) FROM outbox.cursors WHERE owner IS NOT NULL GROUP BY owner "
                        "ORDER BY owner").fetchall()
    return {str(owner): int(n) for owner, n in rows}


def count(conn: psycopg.Connection[Any], sql: str, *params: Any) -> int:
    row = conn.execute(sql, params).fetchone()
    return int(row[0]) if row else 0


def main() -> int:
    started = time.monotonic()
    ok = True
    rng = random.Random(7)
    say("starting embedded PostgreSQL 18 and Tansu (Kafka protocol) ...")
    with EmbeddedPostgres() as pg, EmbeddedKafka() as kafka:
        kafka.create_topic(TOPIC, partitions=PARTITIONS)
        partitions = kafka.partitions(TOPIC)
        say(f"  database {pg.dsn}\n  broker   {kafka.bootstrap_servers}, topic {TOPIC!r} with "
            f"{len(partitions)} partitions")
        examples = str(Path(__file__).resolve().parent)  # the relays import demo_projection from here
        path = os.pathsep.join(p for p in (examples, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "OUTBOX_DSN": pg.dsn, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}

        if run_cli(env, "migrate") != 0:
            return 1
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            create_schema(conn)
            conn.execute(demo_projection.SCHEMA)
            conn.execute("INSERT INTO demo_customers (name) SELECT 'customer-' || i FROM generate_series(0, 6) i")

        say(f"\nstarting {len(RELAYS)} relays: outbox-relay run {' '.join(RELAY_OPTIONS)} ...")
        relays = [Relay(name, env, kafka.bootstrap_servers) for name in RELAYS]
        relay_a, relay_b = relays
        try:
            wait_for(lambda: all(r.started.is_set() or r.proc.poll() is not None for r in relays), 30,
                     "the relays to start")
            if any(r.proc.poll() is not None for r in relays):
                say("a relay exited at start")
                return 1
            # The stored assignment splits the buckets once both relays have seen each other's heartbeat.
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                wait_for(lambda: len(owners(conn)) == len(RELAYS) and sum(owners(conn).values()) == 512, 20,
                         "the relays to split the buckets", interval=0.2)
                say("  buckets (256 per sink, 2 sinks): " + ", ".join(f"{o} {n}" for o, n in owners(conn).items()))

            printer = Printer(kafka.bootstrap_servers, partitions)
            say(f"\nproducing: orders 1-{KILLED_AFTER} placed and paid, each event in the order's own transaction")
            published = produce(pg.dsn, range(1, KILLED_AFTER + 1), rng)
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                again = pay_order(conn, 1, payment_id="pay-1")
                say(f"  produced  order:1   paid again by a retried request: created={again.created} (no new event)")
                say(f"\npoison: order {POISON_ORDER} of {POISON_CUSTOMER!r}, a customer the read model "
                    f"{PROJECTION!r} does not know yet")
                place_order(conn, POISON_ORDER, customer=POISON_CUSTOMER, amount=Decimal("5.00"))
                published.append((f"order:{POISON_ORDER}", "OrderPlaced"))
                wait_for(lambda: count(conn, "SELECT count(*) FROM outbox.dead_letters WHERE sink = %s",
                                       PROJECTION) == 1, 30, "the poison event to be dead-lettered")
            ok = run_cli(env, "dead-letters", "list", "--sink", PROJECTION) == 0 and ok
            wait_for(lambda: len(printer.ids) >= len(published), 30, "every event so far to arrive")

            say("\nSIGKILL to relay-a (no drain: its leases and heartbeat just stop)")
            relay_a.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                wait_for(lambda: owners(conn) == {relay_b.name: 512}, 60, "relay-b to take every bucket over",
                         interval=0.05)
            took = time.monotonic() - killed
            bound = WORKER_TTL_SECONDS + HEARTBEAT_SECONDS
            say(f"  relay-b holds all 512 buckets {took:.1f} s after the kill (bound: relay-a is dead "
                f"--worker-ttl-seconds {WORKER_TTL_SECONDS:g} s after its last heartbeat, which came at most "
                f"--heartbeat-seconds {HEARTBEAT_SECONDS:g} s before the kill; relay-b takes over at its next "
                f"heartbeat after that: about {bound:g} s"
                + (")" if took <= bound + 1 else "; over it here, on a busy machine)"))

            say(f"\nproducing: orders {KILLED_AFTER + 1}-{ORDERS}, with relay-b alone")
            published += produce(pg.dsn, range(KILLED_AFTER + 1, ORDERS + 1), rng)
            expected_ids = len(published)
            wait_for(lambda: len(printer.ids) >= expected_ids, 30, "every event to arrive")
            time.sleep(0.5)  # show a late duplicate, if any
            printer.stop.set()
            printer.thread.join(5)

            by_key: dict[str, list[str]] = defaultdict(list)
            for key, type_ in published:
                by_key[key].append(type_)
            wrong = [k for k, types in by_key.items() if [t for _, t in printer.seen.get(k, [])] != types]
            say(f"\nconsumer: {printer.messages} messages, {len(printer.ids)} distinct events "
                f"(published {expected_ids}); per-key order " + ("ok for all " + str(len(by_key)) + " keys"
                                                                   if not wrong else f"WRONG for {wrong}"))
            ok = ok and not wrong and len(printer.ids) == expected_ids

            say(f"\nthe fix: customer {POISON_CUSTOMER!r} arrives in demo_customers; then retry the dead letter")
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO demo_customers (name) VALUES (%s)", (POISON_CUSTOMER,))
                ok = run_cli(env, "dead-letters", "retry", "--sink", PROJECTION, "--key",
                             f"order:{POISON_ORDER}") == 0 and ok
                wait_for(lambda: count(conn, "SELECT count(*) FROM customer_orders WHERE order_id = %s",
                                       POISON_ORDER) == 1, 30, "the retried event to be applied")
                applied = count(conn, "SELECT count(*) FROM customer_orders")
                dead = count(conn, "SELECT count(*) FROM outbox.dead_letters")
            say(f"  {PROJECTION}: order {POISON_ORDER} applied after the retry; {applied} orders in the read "
                f"model (of {ORDERS + 1} placed), {dead} dead letters left")
            ok = ok and applied == ORDERS + 1 and dead == 0

            ok = run_cli(env, "status") == 0 and ok
            ok = show_metrics(relay_b) and ok
        finally:
            say("\nSIGTERM to the relays (they drain: leave the assignment, finish the batch, release, exit)")
            for r in relays:
                r.terminate()
            for r in relays:
                code = r.wait(30)
                if r is relay_a and code == -signal.SIGKILL:
                    say(f"  {r.name} was killed (SIGKILL) earlier")
                    continue
                say(f"  {r.name} exited with {code}")
                ok = ok and code == 0
    say(f"\n{'done' if ok else 'FAILED'} in {time.monotonic() - started:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TimeoutError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
