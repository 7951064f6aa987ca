"""The webhook sink's own cost per event, next to a bare http.client POST, in one run.

    python bench/webhook.py [--events 2000] [--runs 3]

A local no-op receiver (http.server in its own process, HTTP/1.1 keep-alive, answers 204 without verifying) takes every
request, so what is measured is the client side plus loopback: the CloudEvents headers and the
Standard Webhooks signature (``sink``), against the same POST with only a content-type (``bare``),
each on one kept-alive connection, and the sink with a new connection per event (``sink, new
connection``: what keep-alive saves). ``sign only`` is the HMAC alone. Medians of ``--runs`` with
min/max, per event in microseconds and events/s from one thread.
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
from outbox_relay.webhook import WebhookSecret, WebhookSink

PAYLOAD = '{"order": 12345, "amount": "19.90", "currency": "EUR", "items": [1, 2, 3]}'


class _NoOp(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(204)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def _serve(ports: multiprocessing.Queue[int]) -> None:
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    raise SystemExit(main())
