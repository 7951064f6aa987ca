"""Client CPU of reading one small webhook response: http.client's stock ``HTTPResponse`` next to the
webhook sink's ``TimedResponse`` (every read bounded by the response's deadline), in one run.

    python bench/webhook_response.py [--responses 5000] [--runs 7]

A socketpair in one process, a 204 with four headers written before each parse: CPU time per
response (``time.process_time``), medians of ``--runs`` with min/max, the two cases interleaved.
"""

from __future__ import annotations

import argparse
import http.client
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outbox_relay.sinks.webhook.connection import TimedResponse

RESPONSE = b"HTTP/1.1 204 No Content\r\nServer: x\r\nDate: Thu, 26 Nov 2026 08:00:00 GMT\r\ncontent-length: 0\r\n\r\n"


def per_response(timed: bool, n: int) -> float:
    a, b = socket.socketpair()
    a.settimeout(30)
    start = time.process_time()
    for _ in range(n):
        b.sendall(RESPONSE)
        r = (TimedResponse(a, method="POST", deadline=time.monotonic() + 30) if timed
             else http.client.HTTPResponse(a, method="POST"))
        r.begin()
        r.read(65537)
        r.close()
    a.close()
    b.close()
    return (time.process_time() - start) / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--responses", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"stock HTTPResponse": [], "TimedResponse (deadline)": []}
    for _ in range(args.runs):
        for name, timed in (("stock HTTPResponse", False), ("TimedResponse (deadline)", True)):
            results[name].append(per_response(timed, args.responses))
    print(f"response parse, {args.responses} x {args.runs} runs; {platform.machine()}, {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| case | CPU us/response median (min-max) |\n|---|---|")
    for name, values in results.items():
        print(f"| {name} | {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
