"""The webhook sink's own cost per event, next to a bare http.client POST, in one run.

    python bench/webhook.py [--events 2000] [--runs 3]
    python bench/webhook.py --relay [--concurrency 1,4,16] [--receiver-ms 5] [--events 2000] [--runs 3]

A local no-op receiver (http.server in its own process, HTTP/1.1 keep-alive, answers 204 without verifying) takes every
request, so what is measured is the client side plus loopback: the CloudEvents headers and the
Standard Webhooks signature (``sink``), against the same POST with only a content-type (``bare``),
each on one kept-alive connection, and the sink with a new connection per event (``sink, new
connection``: what keep-alive saves). ``sign only`` is the HMAC alone. Medians of ``--runs`` with
min/max, per event in microseconds and events/s from one thread.

``--relay``: end to end instead, through an embedded relay (a private PostgreSQL 18) whose settings
name the webhook (as ``outbox-relay run --webhook-url``), per webhook concurrency, to a receiver that
takes ``--receiver-ms`` per request.
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outbox_relay.sinks import SinkEvent
from outbox_relay.sinks.webhook import WebhookSecret, WebhookSink

PAYLOAD = '{"order": 12345, "amount": "19.90", "currency": "EUR", "items": [1, 2, 3]}'


class _NoOp(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    latency = 0.0  # seconds the receiver takes per request (set in the receiver's process)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.latency:
            time.sleep(self.latency)
        self.send_response(204)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def _serve(ports: multiprocessing.Queue[int], latency: float = 0.0) -> None:
    _NoOp.latency = latency
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoOp)
    server.daemon_threads = True
    ports.put(server.server_address[1])
    server.serve_forever()


def _event(i: int) -> SinkEvent:
    return SinkEvent(id=uuid.uuid4(), topic="orders", key=f"k{i % 64}", type="order.placed", payload_json=PAYLOAD,
                     headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
                     time=datetime.now(UTC), version=1, attempt=1)


def _timed(n: int, one: Callable[[int], object]) -> tuple[float, float]:
    """Wall and client CPU seconds per call (the CPU figure is the client's own: steadier on a loaded machine)."""
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(n):
        one(i)
    return (time.perf_counter() - start) / n, (time.process_time() - cpu) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--relay", action="store_true",
                        help="instead: end to end through an embedded relay (PostgreSQL 18) per --concurrency")
    parser.add_argument("--concurrency", default="1,4,16", help="--relay: webhook concurrencies to compare")
    parser.add_argument("--receiver-ms", type=float, default=5.0, help="--relay: the receiver's time per request")
    parser.add_argument("--keys", type=int, default=64, help="--relay: keys the events spread over")
    args = parser.parse_args()
    if args.relay:
        return relay_cases(args)
    # The receiver in its own process: in this one, its header parsing would share the GIL with the client.
    ports: multiprocessing.Queue[int] = multiprocessing.Queue()
    receiver = multiprocessing.Process(target=_serve, args=(ports,), daemon=True)
    receiver.start()
    port = ports.get(timeout=30)
    url = f"http://127.0.0.1:{port}/hook"
    secret = WebhookSecret.generate()
    sink = WebhookSink(url, secret)
    fresh = WebhookSink(url, secret)
    bare = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    key = WebhookSecret(secret)
    events = [_event(i) for i in range(args.events)]
    body = PAYLOAD.encode()

    def bare_post(i: int) -> None:
        bare.request("POST", "/hook", body, {"content-type": "application/json"})
        bare.getresponse().read()

    def fresh_post(i: int) -> None:
        fresh.deliver(events[i])
        fresh.close()

    cases: dict[str, Callable[[int], object]] = {
        "bare http.client POST, kept alive": bare_post,
        "sink, kept alive": lambda i: sink.deliver(events[i]),
        "sink, new connection": fresh_post,
        "sign only": lambda i: key.signature(str(events[i].id), 1_700_000_000, body),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for one in cases.values():  # warm-up
        _timed(min(200, args.events), one)
    for _ in range(args.runs):
        for name, one in cases.items():  # interleaved: every case sees the same load
            results[name].append(_timed(args.events, one))
    sink.close()
    bare.close()
    receiver.terminate()
    print(f"webhook sink, {args.events} events x {args.runs} runs, one thread; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC\n")
    print("| case | wall us/event median (min-max) | events/s | client CPU us/event median (min-max) |")
    print("|---|---|---|---|")
    base = statistics.median(cpu for _, cpu in results["bare http.client POST, kept alive"])
    for name, values in results.items():
        wall = [w for w, _ in values]
        cpu = [c for _, c in values]
        med, med_cpu = statistics.median(wall), statistics.median(cpu)
        ratio = f", {med_cpu / base:.2f}x bare" if name != "sign only" else ""
        print(f"| {name} | {med * 1e6:.0f} ({min(wall) * 1e6:.0f}-{max(wall) * 1e6:.0f}) | {1 / med:,.0f} | "
              f"{med_cpu * 1e6:.0f} ({min(cpu) * 1e6:.0f}-{max(cpu) * 1e6:.0f}{ratio}) |")
    return 0


def relay_cases(args: argparse.Namespace) -> int:
    """Events/s from one committed transaction of ``--events`` events until the relay checkpointed them
    all, through the composed webhook sink (``webhook_url`` in the settings, as ``outbox-relay run``),
    to a receiver in its own process that takes ``--receiver-ms`` per request."""
    import tempfile

    import psycopg

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from servers import Postgres, machine
    from user_sink_concurrency import Count

    from outbox_relay import Outbox, Relay
    from outbox_relay.migrate import migrate
    from outbox_relay.settings import load_settings

    ports: multiprocessing.Queue[int] = multiprocessing.Queue()
    receiver = multiprocessing.Process(target=_serve, args=(ports, args.receiver_ms / 1000), daemon=True)
    receiver.start()
    url = f"http://127.0.0.1:{ports.get(timeout=30)}/hook"
    secret = WebhookSecret.generate()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    rates: dict[int, list[float]] = {c: [] for c in concurrencies}
    with tempfile.TemporaryDirectory() as tmp:
        pg = Postgres(Path(tmp))
        try:
            for run in range(args.runs):
                for c in concurrencies if run % 2 == 0 else list(reversed(concurrencies)):
                    name = pg.create_database()
                    dsn = pg.dsn(name)
                    migrate(dsn)
                    count = Count(args.events)
                    relay = Relay(load_settings(dsn=dsn, worker_id="bench", kafka=False, webhook_url=url,
                                                webhook_secret=secret, webhook_concurrency=c, heartbeat_seconds=0.2,
                                                worker_ttl_seconds=1.0), observer=count)
                    relay.start()
                    try:
                        deadline = time.monotonic() + 60
                        while relay.readiness():
                            if time.monotonic() > deadline:
                                raise RuntimeError("relay not ready")
                            time.sleep(0.1)
                        time.sleep(1.0)  # its buckets taken
                        with psycopg.connect(dsn) as conn:
                            Outbox(default_topic="bench").publish_many(conn, [
                                {"key": f"k{i % args.keys}", "type": "bench.hook", "payload": {"n": i}}
                                for i in range(args.events)])
                        start = time.perf_counter()
                        if not count.done.wait(600):
                            raise RuntimeError(f"only {count.n} of {args.events} delivered")
                        rates[c].append(args.events / (time.perf_counter() - start))
                    finally:
                        relay.drain(60)
                        pg.drop_database(name)
            print(f"machine: {machine()}; PostgreSQL {pg.version}; {args.events:,} events over {args.keys} keys, "
                  f"receiver {args.receiver_ms:g} ms per request (own process), {args.runs} runs\n")
            print("| webhook concurrency | events/s median (min-max) | ideal (concurrency x 1000 / receiver ms) |")
            print("|---|---|---|")
            for c, r in rates.items():
                ideal = c * 1000 / args.receiver_ms if args.receiver_ms else float("inf")
                print(f"| {c} | {statistics.median(r):,.0f} ({min(r):,.0f}-{max(r):,.0f}) | {ideal:,.0f} |")
        finally:
            pg.stop()
            receiver.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
