"""Prometheus metrics and health endpoints of a relay (``outbox-relay run --metrics-port PORT``).

One HTTP server per relay process serves:

- ``/metrics``: Prometheus text format. Counters and histograms come from the engine's observer
  calls (batches, leases, failed cycles, producer replacements, housekeeping). Gauges of the whole
  outbox (backlog per sink, the oldest undelivered event, parked and dead-lettered events, the keys
  that lag most, the oldest open writing transaction, when housekeeping last finished) come from a
  background refresh every ``--metrics-refresh-seconds`` on a short-lived connection of its own, so
  a scrape never queries the database and never waits for a relay's connection.
- ``/healthz``: 200 while the process is up and its last heartbeat reached the database within
  ``--worker-ttl-seconds``; else 503. For a liveness probe.
- ``/readyz``: 200 when it is healthy, not draining, holds every bucket it should, and its sinks can
  reach what they deliver to (a Kafka sink: its brokers answer a metadata request); else 503 with the
  reasons. For a readiness probe (a rolling deploy moves on once the new relay has taken its share).

Each metric's name and help text is below; docs/observability.md lists them with the dashboard
(deploy/grafana) and the alert rules (deploy/prometheus).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from . import history
from .dsn import describe_error, redact
from .observer import Observer
from .sqlfiles import query

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("outbox_relay.metrics")

PREFIX = "outbox_relay"
READY_CACHE_SECONDS = 5.0  # the ready gauge re-runs the readiness checks at most this often
TOP_KEYS = 10  # per sink, the keys with most undelivered events and with the oldest one
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
# The metrics port listens on every address by default, so whoever can reach it must not be able to take
# the relay's descriptors or threads: at most this many connections at once (each its own thread; more
# are closed at once), and each is closed this long after it was accepted, answered or not.
MAX_CONNECTIONS = 32
REQUEST_SECONDS = 5.0
DESCRIPTORS_LOG_SECONDS = 60.0  # descriptor exhaustion is logged at most this often
DESCRIPTORS_PAUSE_SECONDS = 0.2  # accepting again after EMFILE: without a pause the accept loop spins


class PrometheusObserver(Observer):
    """The engine's observer calls as Prometheus counters and histograms (thread-safe: the
    prometheus_client types are)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=registry)

        self.delivered = counter("events_delivered_total", "Events delivered (acknowledged by Kafka with an "
                                 "offset, or applied by a projection)", ["sink"])
        self.retried = counter("events_retried_total", "Delivery attempts that failed and wait for a retry", ["sink"])
        self.dead = counter("events_dead_lettered_total", "Events given up on (dead letters)", ["sink"])
        self.held_events = counter("events_held_total", "Events parked to wait for a condition of the sink (a Kafka "
                                   "topic that does not exist or that an ACL denies), no attempt counted", ["sink"])
        self.lease_changes = counter("lease_changes_total", "Bucket leases acquired, lost (fenced out by "
                                     "another relay) or released by this relay", ["sink", "change"])
        self.cycle_failures = counter("cycle_failures_total", "Runner cycles that failed as a whole", ["sink"])
        self.recreations = counter("producer_recreations_total", "Kafka producers replaced (a broker that "
                                   "forgot the producer, a fatal error, a stall)", ["sink"])
        self.housekeeping_runs = counter("housekeeping_runs_total", "Housekeeping passes this relay ran")
        self.expired = counter("leases_expired_total", "Leases found expired and freed by this relay's housekeeping")
        self.deleted = counter("retention_deleted_total", "Delivered events deleted by retention on this relay")
        self.latency = Histogram(f"{PREFIX}_delivery_latency_seconds", "From when an event became visible to the "
                                 "relay (its commit, bounded by the last read that could not see it yet) to the "
                                 "checkpoint after its delivery", ["sink"], buckets=LATENCY_BUCKETS, registry=registry)
        self.age = Histogram(f"{PREFIX}_event_age_seconds", "From an event's storing (its transaction's start) to "
                             "the checkpoint after its delivery, by the database's clock: includes the time the "
                             "producer's transaction stayed open", ["sink"], buckets=LATENCY_BUCKETS, registry=registry)
        self.batch_size = Histogram(f"{PREFIX}_batch_size_events", "Events per checkpointed batch", ["sink"],
                                    buckets=BATCH_BUCKETS, registry=registry)
        self.housekeeping_seconds = Histogram(f"{PREFIX}_housekeeping_duration_seconds",
                                              "How long this relay's housekeeping passes took", registry=registry)

    def sinks(self, names: Iterable[str]) -> None:
        """Create every sink's series at 0, so that ``increase()`` sees the first event of each."""
        for sink in names:
            for metric in (self.delivered, self.retried, self.dead, self.held_events, self.cycle_failures,
                           self.recreations):
                metric.labels(sink)
            for change in ("acquired", "lost", "released"):
                self.lease_changes.labels(sink, change)

    def batch(self, sink: str, *, size: int, delivered: int, retried: int, dead: int,
              latencies: Sequence[float]) -> None:
        self.delivered.labels(sink).inc(delivered)
        if retried:
            self.retried.labels(sink).inc(retried)
        if dead:
            self.dead.labels(sink).inc(dead)
        self.batch_size.labels(sink).observe(size)
        histogram = self.latency.labels(sink)
        for seconds in latencies:
            histogram.observe(max(0.0, seconds))

    def ages(self, sink: str, seconds: Sequence[float]) -> None:
        histogram = self.age.labels(sink)
        for s in seconds:
            histogram.observe(max(0.0, s))

    def held(self, sink: str, events: int) -> None:
        self.held_events.labels(sink).inc(events)

    def leases(self, sink: str, *, acquired: int = 0, lost: int = 0, released: int = 0) -> None:
        for change, n in (("acquired", acquired), ("lost", lost), ("released", released)):
            if n:
                self.lease_changes.labels(sink, change).inc(n)

    def cycle_failed(self, sink: str, error: str) -> None:
        self.cycle_failures.labels(sink).inc()

    def producer_recreated(self, sink: str, reason: str) -> None:
        self.recreations.labels(sink).inc()

    def housekeeping(self, *, seconds: float, dead_workers: int, expired_leases: int, deleted_events: int) -> None:
        self.housekeeping_runs.inc()
        self.housekeeping_seconds.observe(seconds)
        self.expired.inc(expired_leases)
        self.deleted.inc(deleted_events)


class OutboxGauges(Collector):
    """Gauges of the relay process (read at scrape time) and of the whole outbox (the last background
    refresh; ``outbox_relay_metrics_refresh_age_seconds`` says how old it is)."""

    def __init__(self, worker: Worker, dsn: str, refresh_seconds: float) -> None:
        self.worker = worker
        self.dsn = dsn
        self.refresh_seconds = refresh_seconds
        self._lock = threading.Lock()
        self._sinks: list[tuple[str, int, float | None, int, int, int, int]] = []
        self._keys: list[tuple[str, str, int, float]] = []
        self._cluster: tuple[float | None, float | None] = (None, None)
        # Per retention class: partitions, bytes, age of the oldest event, held by something other than
        # its retention (a sink, a parked event, a dead letter, a rebuild).
        self._history: list[tuple[str, int, int, float | None, bool]] = []
        self._refreshed: float | None = None  # monotonic time of the last good refresh
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-refresh", daemon=True)
        self._ready: tuple[float, bool] | None = None  # (monotonic time, answer): readiness asks the brokers

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.refresh_seconds)

    def ready(self) -> bool:
        now = time.monotonic()
        if self._ready is None or now - self._ready[0] > READY_CACHE_SECONDS:
            self._ready = (now, not self.worker.readiness())
        return self._ready[1]

    def refresh(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=10,
                                 application_name="outbox-relay metrics") as conn:
                conn.execute("SET statement_timeout = '30s'")
                # One snapshot for the floor and the reads it bounds (a sink registered in between
                # starts below it).
                with conn.transaction():
                    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    floor = conn.execute(query("metrics", "floor")).fetchone()
                    bound = {"floor": floor[0] if floor else None}
                    sinks = [(r[0], int(r[1]), r[2], int(r[3]), int(r[4]), int(r[5]), int(r[6]))
                             for r in conn.execute(query("metrics", "sinks"), bound).fetchall()]
                    keys = [(r[0], r[1], int(r[2]), float(r[3]))
                            for r in conn.execute(query("metrics", "key_lag"), {"top": TOP_KEYS, **bound}).fetchall()]
                row = conn.execute(query("metrics", "cluster")).fetchone()
                cols, classes = history.rows(conn, "by_class", self.worker.settings.retention_seconds)
        except psycopg.Error as exc:
            log.warning("metrics: could not refresh the outbox gauges: %s", redact(describe_error(exc)))
            return
        with self._lock:
            self._sinks, self._keys = sinks, keys
            self._cluster = (row[0], row[1]) if row else (None, None)
            self._history = [_history_row(dict(zip(cols, r, strict=True))) for r in classes]
            self._refreshed = time.monotonic()

    def collect(self) -> Iterable[GaugeMetricFamily]:
        w = self.worker
        held = GaugeMetricFamily(f"{PREFIX}_buckets_held", "Buckets this relay holds a lease on", labels=["sink"])
        wanted = GaugeMetricFamily(f"{PREFIX}_buckets_assigned", "Buckets the assignment gives this relay",
                                   labels=["sink"])
        stuck = GaugeMetricFamily(f"{PREFIX}_sink_stuck", "1 while a sink's runner makes no progress (a call that "
                                  "does not return, or every cycle failing) and has given its buckets up",
                                  labels=["sink"])
        for r in w.runners:
            held.add_metric([r.sink.name], len(r.leases.snapshot()))
            wanted.add_metric([r.sink.name], len(r.desired or ()))
            stuck.add_metric([r.sink.name], 0.0 if r.stuck() is None else 1.0)
        yield held
        yield wanted
        # A sink that can hold a destination (KafkaSink.conditions: a topic missing or denied) says which.
        topics = GaugeMetricFamily(f"{PREFIX}_topic_held_seconds", "Seconds a topic's events have been waiting for "
                                   "the topic to exist or for an ACL to allow it (present only while they wait)",
                                   labels=["sink", "topic"])
        now = time.monotonic()
        for r in w.runners:
            conditions = getattr(r.sink, "conditions", None)
            for topic, condition in (conditions() if conditions is not None else {}).items():
                topics.add_metric([r.sink.name, topic], now - condition.since)
        yield topics
        yield stuck
        yield GaugeMetricFamily(f"{PREFIX}_listening", "1 while the LISTEN connection is up (else the relay polls)",
                                value=1.0 if w.listening else 0.0)
        yield GaugeMetricFamily(f"{PREFIX}_draining", "1 once the relay is draining", value=float(w.stopping.is_set()))
        yield GaugeMetricFamily(f"{PREFIX}_ready", "1 while /readyz answers 200 (checked at most every few seconds)",
                                value=1.0 if self.ready() else 0.0)
        with self._lock:
            sinks, keys, cluster, refreshed = self._sinks, self._keys, self._cluster, self._refreshed
            classes = self._history
        age = GaugeMetricFamily(f"{PREFIX}_metrics_refresh_age_seconds",
                                "Seconds since the outbox gauges below were read from the database")
        if refreshed is not None:
            age.add_metric([], time.monotonic() - refreshed)
        yield age
        pending = GaugeMetricFamily(f"{PREFIX}_pending_events", "Committed events a sink has not delivered yet",
                                    labels=["sink"])
        oldest = GaugeMetricFamily(f"{PREFIX}_oldest_pending_age_seconds",
                                   "Age of the oldest committed event a sink has not delivered yet", labels=["sink"])
        parked = GaugeMetricFamily(f"{PREFIX}_parked_events", "Events waiting for a retry, or behind one of their "
                                   "key (not those of paused keys)", labels=["sink"])
        paused = GaugeMetricFamily(f"{PREFIX}_paused_events", "Events held by paused keys (outbox-relay keys pause)",
                                   labels=["sink"])
        paused_keys = GaugeMetricFamily(f"{PREFIX}_paused_keys", "Keys an operator paused", labels=["sink"])
        dead = GaugeMetricFamily(f"{PREFIX}_dead_letters", "Dead letters", labels=["sink"])
        for name, n, age_s, n_parked, n_paused, n_paused_keys, n_dead in sinks:
            pending.add_metric([name], n)
            oldest.add_metric([name], age_s or 0.0)
            parked.add_metric([name], n_parked)
            paused.add_metric([name], n_paused)
            paused_keys.add_metric([name], n_paused_keys)
            dead.add_metric([name], n_dead)
        yield from (pending, oldest, parked, paused, paused_keys, dead)
        key_pending = GaugeMetricFamily(f"{PREFIX}_key_pending_events", f"Undelivered events of the {TOP_KEYS} "
                                        "keys with most, and of the keys that wait longest, per sink",
                                        labels=["sink", "key"])
        key_oldest = GaugeMetricFamily(f"{PREFIX}_key_oldest_pending_age_seconds", "Age of the oldest undelivered "
                                       "event of the same keys", labels=["sink", "key"])
        for sink, key, n, age_s in keys:
            key_pending.add_metric([sink, key], n)
            key_oldest.add_metric([sink, key], age_s)
        yield key_pending
        yield key_oldest
        open_tx = GaugeMetricFamily(f"{PREFIX}_oldest_writing_transaction_age_seconds",
                                    "Age of the oldest open writing transaction on the server, a session's or "
                                    "a prepared one (0: none)")
        open_tx.add_metric([], cluster[0] or 0.0)
        yield open_tx
        housekeeping = GaugeMetricFamily(f"{PREFIX}_housekeeping_last_finished_age_seconds",
                                         "Seconds since housekeeping (on any relay) last finished a pass")
        if cluster[1] is not None:
            housekeeping.add_metric([], cluster[1])
        yield housekeeping
        yield from _history_gauges(classes)


# What keeps a class's oldest partition that is not its own retention (partition_hold_v1's words).
_NOT_BLOCKED = ("within retention", "retention class", "empty", "still being written")


def _history_row(r: dict[str, Any]) -> tuple[str, int, int, float | None, bool]:
    oldest = r["oldest_event"]
    age = (datetime.now(UTC) - oldest).total_seconds() if oldest is not None else None
    held = r["held_by"]
    return (str(r["class"]), int(r["partitions"]), int(r["bytes"] or 0), age,
            held is not None and not str(held).startswith(_NOT_BLOCKED))


def _history_gauges(classes: list[tuple[str, int, int, float | None, bool]]) -> Iterable[GaugeMetricFamily]:
    parts = GaugeMetricFamily(f"{PREFIX}_history_partitions", "Partitions of outbox.events per retention class "
                              "('(all)': events_default and events_legacy)", labels=["class"])
    size = GaugeMetricFamily(f"{PREFIX}_history_bytes", "Bytes of stored history per retention class",
                             labels=["class"])
    oldest = GaugeMetricFamily(f"{PREFIX}_history_oldest_event_age_seconds",
                               "Age of the oldest stored event per retention class", labels=["class"])
    blocked = GaugeMetricFamily(f"{PREFIX}_history_retention_blocked", "1 while the class's oldest partition is "
                                "held by a sink, a parked event, a dead letter or a rebuild (outbox-relay retention "
                                "list says which), not by its retention", labels=["class"])
    for name, n, nbytes, age, held in classes:
        parts.add_metric([name], n)
        size.add_metric([name], nbytes)
        if age is not None:
            oldest.add_metric([name], age)
        blocked.add_metric([name], 1.0 if held else 0.0)
    yield from (parts, size, oldest, blocked)


class Probes(Protocol):
    """What ``/healthz`` and ``/readyz`` ask: the problems found, none when all is well."""

    def health(self) -> list[str]: ...

    def readiness(self) -> list[str]: ...


class EndpointServer:
    """``/metrics`` (the registry), ``/healthz`` and ``/readyz`` (the probes) on one port, on a thread of
    its own: the HTTP part, shared by the relay (``MetricsServer``) and the inbox consumer."""

    def __init__(self, probes: Probes, registry: CollectorRegistry, host: str, port: int) -> None:
        self.probes = probes
        self.registry = registry
        self.server = BoundedHTTPServer((host, port), _handler(self))
        self._thread = threading.Thread(target=self.server.serve_forever, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> None:
        self._thread.start()
        log.info("metrics, /healthz and /readyz on port %d", self.port)

    def close(self) -> None:
        # shutdown() waits until serve_forever() has noticed it: with no serving thread (start() never
        # ran, e.g. the worker was refused before starting) it would wait forever.
        if self._thread.is_alive():
            self.server.shutdown()
        self.server.server_close()


class MetricsServer(EndpointServer):
    """A relay's endpoints, with the outbox gauges refreshed in the background, for a worker's lifetime."""

    def __init__(self, worker: Worker, registry: CollectorRegistry, host: str, port: int,
                 refresh_seconds: float) -> None:
        self.worker = worker
        self.gauges = OutboxGauges(worker, worker.settings.dsn.get_secret_value(), refresh_seconds)
        registry.register(self.gauges)
        super().__init__(worker, registry, host, port)

    def start(self) -> None:
        self.gauges.start()
        super().start()

    def close(self) -> None:
        self.gauges.stop()
        super().close()


class BoundedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server with bounds: ``MAX_CONNECTIONS`` open connections (one thread each), each
    closed ``REQUEST_SECONDS`` after it was accepted; descriptor exhaustion is logged, not spun on; a
    client that hangs up is not an error (no traceback on stderr, which --log-json keeps to JSON)."""

    daemon_threads = True
    block_on_close = False
    # listen() backlog: socketserver's 5 overflowed under a burst of probes and scrapes (the kernel then
    # drops SYNs, and each client waited out a 1 s retransmit); MAX_CONNECTIONS still bounds the threads.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._lock = threading.Lock()
        # Open connections and when each must be closed (monotonic); the serving thread reaps them.
        self._open: dict[socket.socket, float] = {}
        self._exhausted_logged: float | None = None
        self.refused = 0  # connections closed at once because MAX_CONNECTIONS were open

    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self._lock:
            if len(self._open) >= MAX_CONNECTIONS:
                self.refused += 1
                return False  # socketserver closes it
            self._open[request] = time.monotonic() + REQUEST_SECONDS
        return True

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def service_actions(self) -> None:
        """Between accepts (every half second): cut connections past their time, idle or slow ones, so
        that their threads return and their descriptors close."""
        now = time.monotonic()
        with self._lock:
            late = [sock for sock, deadline in self._open.items() if deadline < now]
            # A cut connection stops counting at once: its client sees it closed now, and the thread that
            # closes it may not run for a while on a busy machine (a probe right after was refused: seen in CI).
            for sock in late:
                del self._open[sock]
        for sock in late:
            with contextlib.suppress(OSError):  # closed meanwhile
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it; it closes the socket

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return self.socket.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self._descriptors_exhausted(exc)
            raise

    def _descriptors_exhausted(self, exc: OSError) -> None:
        now = time.monotonic()
        if self._exhausted_logged is None or now - self._exhausted_logged >= DESCRIPTORS_LOG_SECONDS:
            self._exhausted_logged = now
            log.error("metrics: can not accept a connection: %s: the process is out of file descriptors "
                      "(RLIMIT_NOFILE; the database and broker connections need them too). Raise LimitNOFILE "
                      "(systemd) or the container's nofile limit, and look for what holds them (ls /proc/%d/fd)",
                      exc.strerror, os.getpid())
        # The listening socket stays readable until a descriptor frees up: wait instead of spinning.
        time.sleep(DESCRIPTORS_PAUSE_SECONDS)

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # the client hung up, reset, timed out, or was cut (service_actions)
            log.debug("metrics: connection from %s ended: %s", client_address, exc)
            return
        log.warning("metrics: a request from %s failed", client_address, exc_info=True)


def _handler(server: EndpointServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_SECONDS  # each read and write on the connection (service_actions bounds the total)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(server.registry))
            elif path in ("/healthz", "/readyz"):
                problems = server.probes.health() if path == "/healthz" else server.probes.readiness()
                body = json.dumps({"ok": not problems, "problems": problems}).encode()
                self._send(503 if problems else 200, "application/json", body)
            else:
                self._send(404, "text/plain", b"not found: /metrics, /healthz, /readyz\n")

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # probes every few seconds would flood the log

    return Handler
