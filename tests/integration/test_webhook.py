"""The webhook sink under the real relay: real PostgreSQL, a real HTTP(S) receiver in a thread.

Each relay is built as ``outbox-relay run`` builds it (compose.build_worker from settings with
``webhook_url``); the receiver verifies every signature with ``outbox_relay.webhook.verify``. The
last test runs ``outbox-relay run`` processes and kills one mid-way.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from outbox_relay.compose import build_worker
from outbox_relay.sinks.webhook import WebhookSink
from outbox_relay.testing import SinkContract
from tests.integration.relay_helpers import dead_letters, make_settings, parked_ids, publish, running
from tests.webhook_receiver import SECRET, Received, Receiver, Reply, receiving, self_signed

SINK = "webhook"
TOPIC = "orders"


def relay(dsn: str, receiver: Receiver, worker_id: str = "w1", **overrides: Any) -> Any:
    values: dict[str, Any] = {"webhook_url": receiver.url, "webhook_secret": SECRET, "webhook_timeout_seconds": 5.0,
                              "webhook_concurrency": 4}
    values.update(overrides)
    return build_worker(make_settings(dsn, worker_id, **values))


def firsts_per_key(received: list[Received]) -> dict[str, list[uuid.UUID]]:
    """Per key, the event ids in the order of their first request among ``received`` (deduped by webhook-id)."""
    seen: set[str] = set()
    out: dict[str, list[uuid.UUID]] = defaultdict(list)
    for r in received:
        if r.id not in seen:
            seen.add(r.id)
            out[r.key].append(uuid.UUID(r.id))
    return dict(out)


def published_per_key(events: list[tuple[str, str, Any]], ids: list[uuid.UUID]) -> dict[str, list[uuid.UUID]]:
    out: dict[str, list[uuid.UUID]] = defaultdict(list)
    for (key, _t, _p), event_id in zip(events, ids, strict=True):
        out[key].append(event_id)
    return dict(out)


def batch(keys: int, per_key: int) -> list[tuple[str, str, Any]]:
    return [(f"key-{k}", "order.placed", {"k": k, "n": n}) for n in range(per_key) for k in range(keys)]


def test_events_arrive_signed_once_each_in_order_per_key_with_keys_in_parallel(dsn: str) -> None:
    in_flight = 0
    most = 0
    lock = threading.Lock()

    def respond(_r: Received, _n: int) -> Reply:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        time.sleep(0.02)  # long enough for the relay's keys to overlap
        with lock:
            in_flight -= 1
        return Reply(204)

    with receiving(respond) as receiver:
        events = batch(keys=8, per_key=10)
        with running(relay(dsn, receiver)):
            ids = publish(dsn, events, topic=TOPIC)
            got = receiver.wait_for(lambda got: len({r.id for r in got}) >= len(ids))
    assert all(r.verified for r in got), "every request carries a valid signature"
    assert sorted(r.id for r in got) == sorted(str(i) for i in ids), "each event once (no fault, no duplicate)"
    assert firsts_per_key(got) == published_per_key(events, ids)
    assert most >= 2, "keys are delivered concurrently (webhook_concurrency)"
    assert all(r.headers["ce-topic"] == TOPIC and r.headers["ce-type"] == "order.placed" for r in got)


def test_only_the_topics_asked_for_are_posted(dsn: str) -> None:
    with receiving() as receiver, running(relay(dsn, receiver, webhook_topics="orders,refunds")):
        wanted = publish(dsn, [("k", "t", {"n": 1})], topic="orders")
        publish(dsn, [("k", "t", {"n": 2})], topic="payments")
        wanted += publish(dsn, [("k", "t", {"n": 3})], topic="refunds")
        got = receiver.wait_for(lambda got: len(got) >= 2)
        time.sleep(0.5)  # time enough for the other one to come, were it not filtered out
    assert [r.id for r in receiver.received] == [str(i) for i in wanted]
    assert [r.headers["ce-topic"] for r in got] == ["orders", "refunds"]


def test_a_5xx_is_retried_and_holds_only_its_key(dsn: str) -> None:
    events = batch(keys=3, per_key=5)
    failing: set[str] = set()

    def respond(r: Received, n: int) -> Reply:
        if r.id in failing and n <= 2:
            return Reply(500, body=b"database is restarting")
        return Reply(200)

    with receiving(respond) as receiver:
        ids = publish(dsn, events, topic=TOPIC)
        head = str(ids[3])  # events interleave by key: index 3 is key-0's second event
        assert events[3][0] == "key-0"
        failing.add(head)
        with running(relay(dsn, receiver)):
            got = receiver.wait_for(lambda _got: receiver.ok_ids() >= {str(i) for i in ids})
    tries = [i for i, r in enumerate(got) if r.id == head]
    assert len(tries) == 3 and [got[i].status for i in tries] == [500, 500, 200]
    # no event is attempted before every earlier one of its key is done; accepted in publish order per key
    assert firsts_per_key(got) == published_per_key(events, ids)
    assert firsts_per_key(receiver.accepted()) == published_per_key(events, ids)
    key0_later = {str(i) for (k, _t, _p), i in zip(events[4:], ids[4:], strict=True) if k == "key-0"}
    assert all(i > tries[-1] for i, r in enumerate(got) if r.id in key0_later)
    assert dead_letters(dsn, SINK) == {}


def test_a_flapping_receiver_still_gets_every_event_in_order_per_key(dsn: str) -> None:
    # about one request in two fails (500, 503, a cut connection), decided by a hash: reproducible
    def respond(r: Received, n: int) -> Reply:
        roll = hashlib.sha256(f"{r.id}/{n}".encode()).digest()[0] % 6
        if n < 4 and roll == 0:
            return Reply(500)
        if n < 4 and roll == 1:
            return Reply(503, {"Retry-After": "0"})
        if n < 4 and roll == 2:
            return Reply(close=True)
        return Reply(202)

    events = batch(keys=6, per_key=12)
    with receiving(respond) as receiver, running(relay(dsn, receiver)):
        ids = publish(dsn, events, topic=TOPIC)
        got = receiver.wait_for(lambda _got: receiver.ok_ids() >= {str(i) for i in ids}, timeout=60)
    assert any(not r.ok for r in got), "the receiver did flap"
    assert firsts_per_key(got) == published_per_key(events, ids), "attempts per key never reorder"
    assert firsts_per_key(receiver.accepted()) == published_per_key(events, ids)
    assert dead_letters(dsn, SINK) == {}
    assert all(r.verified for r in got)


def test_429_retry_after_is_honoured(dsn: str) -> None:
    def respond(_r: Received, n: int) -> Reply:
        return Reply(429, {"Retry-After": "2"}) if n == 1 else Reply(200)

    with receiving(respond) as receiver, running(relay(dsn, receiver)):
        [event_id] = publish(dsn, [("k", "t", {})], topic=TOPIC)
        got = receiver.wait_for(lambda got: len(got) >= 2)
    first, second = got[0], got[1]
    assert first.id == second.id == str(event_id)
    assert second.at - first.at >= 1.9, "the retry waited for Retry-After, not the 0.01 s backoff"


def test_other_4xx_dead_letters_at_once_with_the_response_and_the_key_goes_on(dsn: str) -> None:
    def respond(r: Received, _n: int) -> Reply:
        if r.payload.get("bad"):
            return Reply(422, body=b'{"error": "amount must be positive"}\n')
        return Reply(200)

    with receiving(respond) as receiver:
        with running(relay(dsn, receiver)):
            ids = publish(dsn, [("k", "t", {"n": 1}), ("k", "t", {"bad": True}), ("k", "t", {"n": 3})], topic=TOPIC)
            receiver.wait_for(lambda got: str(ids[2]) in {r.id for r in got})
            deadline = time.monotonic() + 10
            while ids[1] not in dead_letters(dsn, SINK) and time.monotonic() < deadline:
                time.sleep(0.05)
        got = list(receiver.received)
    assert [r.id for r in got] == [str(i) for i in ids], "the refused event was tried once, the next one went on"
    attempts, error = dead_letters(dsn, SINK)[ids[1]]
    assert attempts == 1
    assert "HTTP 422" in error and 'amount must be positive' in error and "tenant" not in error


def test_a_slow_receiver_is_timed_out_and_retried(dsn: str) -> None:
    def respond(_r: Received, n: int) -> Reply:
        return Reply(delay=1.5) if n == 1 else Reply(200)

    with receiving(respond) as receiver, running(relay(dsn, receiver, webhook_timeout_seconds=0.3)):
        [event_id] = publish(dsn, [("k", "t", {})], topic=TOPIC)
        got = receiver.wait_for(lambda got: len(got) >= 2)
    assert [r.id for r in got] == [str(event_id)] * 2
    # the relay gave up on the first request long before it was answered
    assert got[1].at - got[0].at < 1.0 or got[0].at > got[1].at


def test_a_receiver_that_is_down_holds_events_without_spending_attempts(dsn: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it until the receiver starts below
    url = f"http://127.0.0.1:{port}/hooks"
    with running(build_worker(make_settings(dsn, "w1", webhook_url=url, webhook_secret=SECRET, max_attempts=2))):
        ids = publish(dsn, [("k", "t", {"n": n}) for n in range(3)], topic=TOPIC)
        time.sleep(3.0)  # many backoff periods (0.01-0.05 s): 2 counted attempts would have dead-lettered them
        assert dead_letters(dsn, SINK) == {}
        with receiving(port=port) as receiver:
            got = receiver.wait_for(lambda got: len(got) >= 3, timeout=30)
    assert [r.id for r in got] == [str(i) for i in ids]
    assert dead_letters(dsn, SINK) == {} and parked_ids(dsn, SINK) == set()


@pytest.fixture(name="certs", scope="module")
def certs_fixture(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("certs"), "server")


def test_tls_with_a_self_signed_certificate_and_its_ca_file(dsn: str, certs: tuple[Path, Path]) -> None:
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certs)
    with receiving(tls=context) as receiver, running(relay(dsn, receiver, webhook_ca_file=certs[0])):
        ids = publish(dsn, [("k", "t", {"n": n}) for n in range(5)], topic=TOPIC)
        got = receiver.wait_for(lambda got: len(got) >= 5)
    assert [r.id for r in got] == [str(i) for i in ids] and all(r.verified for r in got)


# -- outbox-relay run processes, one killed mid-way


def _start_relay(dsn: str, url: str, worker_id: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OUTBOX_DSN": dsn, "OUTBOX_WEBHOOK_SECRET": SECRET, "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "outbox_relay.cli", "run", "--worker-id", worker_id, "--no-kafka",
            "--webhook-url", url, "--webhook-concurrency", "4", "--lease-seconds", "2", "--heartbeat-seconds", "0.3",
            "--worker-ttl-seconds", "1.5", "--housekeeping-seconds", "0.3", "--poll-seconds", "0.1",
            "--no-listen", "--backoff-base-seconds", "0.05", "--backoff-max-seconds", "0.2"]
    with log.open("wb") as out:
        return subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture(name="processes")
def processes_fixture(tmp_path: Path) -> Iterator[list[tuple[subprocess.Popen[bytes], Path]]]:
    started: list[tuple[subprocess.Popen[bytes], Path]] = []
    yield started
    for proc, log in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        print(f"--- {log.name} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))


@pytest.mark.slow
def test_a_relay_killed_mid_way_loses_nothing_and_the_receiver_dedupes(
        dsn: str, tmp_path: Path, processes: list[tuple[subprocess.Popen[bytes], Path]]) -> None:
    events = batch(keys=6, per_key=40)
    with receiving(lambda _r, _n: Reply(200, delay=0.01)) as receiver:
        ids = publish(dsn, events, topic=TOPIC)
        first = _start_relay(dsn, receiver.url, "relay-a", tmp_path / "a.log")
        processes.append((first, tmp_path / "a.log"))
        receiver.wait_for(lambda got: len(got) >= 60, timeout=60)
        first.send_signal(signal.SIGKILL)  # mid-way: requests in flight, nothing drained
        first.wait(10)
        at_kill = len(receiver.received)
        assert at_kill < len(ids), "the kill came before the end"
        second = _start_relay(dsn, receiver.url, "relay-b", tmp_path / "b.log")
        processes.append((second, tmp_path / "b.log"))
        got = receiver.wait_for(lambda got: {r.id for r in got if r.verified} >= {str(i) for i in ids}, timeout=90)
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    # http.client sends a request's headers and its body in two writes: the kill can fall between them,
    # and the receiver then gets headers and a cut body, which does not verify (a receiver refuses it).
    cut = [r for r in got if not r.verified]
    assert all(len(r.body) < int(r.headers["content-length"]) for r in cut), "only requests the kill cut short"
    # what a receiver that dedupes by webhook-id applied: every event, in publish order per key
    assert firsts_per_key([r for r in got if r.verified]) == published_per_key(events, ids)
    for _proc, log in processes:
        assert SECRET not in log.read_text(errors="replace") and SECRET[6:] not in log.read_text(errors="replace")
    duplicates = len(got) - len({r.id for r in got})
    print(f"{len(got)} requests for {len(ids)} events: {duplicates} redelivered after the kill (at {at_kill})")


# -- the contract suite (outbox_relay.testing.SinkContract) against the webhook sink


class TestWebhookSinkContract(SinkContract):
    """Every test of the suite, ``break_downstream`` included: the receiver stopped ("down"), answering
    400 ("rejects"), or holding requests unanswered past the time limit ("hangs")."""

    @pytest.fixture(autouse=True)
    def _receivers(self) -> Iterator[None]:
        self.release = threading.Event()
        self.receivers = [Receiver(self._respond).start()]
        self.rejecting = False
        self.hanging = False
        yield
        self.release.set()
        for r in self.receivers:
            r.stop()

    def _respond(self, _r: Received, _n: int) -> Reply:
        if self.rejecting:
            return Reply(400, body=b"no such order")
        if self.hanging:
            self.release.wait(10)
        return Reply(204)

    def make_sink(self) -> Any:
        # a read timeout past the suite's time limit: "hangs" is the adapter's to abandon
        return WebhookSink(self.receivers[0].url, SECRET, timeout_seconds=30.0, unavailable_seconds=0.2)

    def received(self, sink: Any) -> Sequence[uuid.UUID]:
        return [uuid.UUID(r.id) for receiver in self.receivers for r in receiver.accepted() if r.verified]

    def break_downstream(self, sink: Any, how: str) -> contextlib.AbstractContextManager[None]:
        return self._broken(sink, how)

    @contextlib.contextmanager
    def _broken(self, sink: WebhookSink, how: str) -> Iterator[None]:
        if how == "down":
            port = self.receivers[-1].port
            self.receivers[-1].stop()
            sink.close()  # its kept-alive connections went with the server
            try:
                yield
            finally:
                self.receivers.append(Receiver(self._respond, port=port).start())
        elif how == "rejects":
            self.rejecting = True
            try:
                yield
            finally:
                self.rejecting = False
        else:
            self.hanging = True
            try:
                yield
            finally:
                self.hanging = False
                self.release.set()


def test_a_receiver_that_echoes_the_target_does_not_show_the_urls_query(
        dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    # Express's 404 says "Cannot POST /hook?token=...", in text and in an HTML page; a long one is cut
    # by the excerpt, so a token near the cut must not leave its first half behind either.
    token = "s3cr3t-t0ken-" + uuid.uuid4().hex
    bodies = {"text": lambda p: f"Cannot POST {p}".encode(),
              "html": lambda p: f"<pre>Cannot POST {p.replace('&', '&amp;')}</pre>".encode(),
              "decoded": lambda p: f"no route {urllib.parse.unquote(p)}".encode(),
              "cut": lambda p: (b"x" * 280) + f" {p}".encode()}

    def respond(r: Received, _n: int) -> Reply:
        return Reply(404, body=bodies[r.payload["how"]](r.path))

    caplog.set_level("DEBUG", logger="outbox_relay")
    with receiving(respond) as receiver:
        url = f"{receiver.scheme}://localhost:{receiver.port}/hook?token={token}&sig=a%2Fb%3Dc"
        with running(relay(dsn, receiver, webhook_url=url)):
            ids = publish(dsn, [(f"k{how}", "t", {"how": how}) for how in bodies], topic=TOPIC)
            deadline = time.monotonic() + 20
            while len(dead_letters(dsn, SINK)) < len(ids) and time.monotonic() < deadline:
                time.sleep(0.05)
    letters = dead_letters(dsn, SINK)
    assert set(letters) == set(ids)
    assert all(r.path.endswith(token + "&sig=a%2Fb%3Dc") for r in receiver.received), "the token was sent"
    shown = [error for _a, error in letters.values()] + [r.getMessage() for r in caplog.records]
    for text in shown:
        assert token[:20] not in text and "a/b=c" not in text and "a%2Fb" not in text, text
    assert all("HTTP 404" in error and "***" in error for _a, error in letters.values())
    assert any("dead-lettered after 1 attempt: " in r.getMessage() for r in caplog.records), "not '1 attempts'"
