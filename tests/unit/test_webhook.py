"""The webhook sink's HTTP side, called directly (``deliver``) against a real HTTP(S) server in a thread.

No database: what the relay does with the outcomes is tested in tests/integration/test_webhook.py.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import pytest

from outbox_relay.dsn import describe_error
from outbox_relay.errors import ConfigurationError
from outbox_relay.settings import RelaySettings, WebhookSettings, load_settings
from outbox_relay.sinks import Delivered, GiveUp, Retry, SinkEvent, SinkUnavailable
from outbox_relay.sinks.webhook import (
    InvalidSignature,
    WebhookSecret,
    WebhookSink,
    excerpt,
    from_env,
    from_settings,
    parse_retry_after,
    verify,
)
from tests.webhook_receiver import SECRET, Receiver, Reply, receiving, self_signed

# The example of the Standard Webhooks specification (and its libraries' tests).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def event(key: str = "order-1", payload: str = '{"n": 1, "name": "caf\\u00e9"}', **kw: Any) -> SinkEvent:
    values: dict[str, Any] = {
        "id": uuid.uuid4(), "topic": "orders", "key": key, "type": "order.placed", "payload_json": payload,
        "headers": {}, "time": datetime(2026, 11, 26, 4, 0, 1, 250000, tzinfo=UTC), "version": 2, "attempt": 1,
    }
    values.update(kw)
    return SinkEvent(**values)


@pytest.fixture(name="receiver")
def receiver_fixture() -> Iterator[Receiver]:
    with receiving() as r:
        yield r


_made: list[WebhookSink] = []


@pytest.fixture(autouse=True)
def _close_sinks() -> Iterator[None]:
    yield
    while _made:
        _made.pop().close()


def sink_for(receiver: Receiver, **kw: Any) -> WebhookSink:
    kw.setdefault("timeout_seconds", 5.0)
    sink = WebhookSink(receiver.url, SECRET, name="hooks", **kw)
    _made.append(sink)
    return sink


# -- signing


def test_signature_matches_the_standard_webhooks_example() -> None:
    assert WebhookSecret(SPEC_SECRET).signature(SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE
    headers = {"Webhook-Id": SPEC_ID, "Webhook-Timestamp": str(SPEC_TIMESTAMP), "Webhook-Signature": SPEC_SIGNATURE}
    assert verify(SPEC_SECRET, headers, SPEC_BODY, now=SPEC_TIMESTAMP + 10) == SPEC_ID


def test_verify_refuses_tampering_other_secrets_and_stale_timestamps() -> None:
    headers = {"webhook-id": SPEC_ID, "webhook-timestamp": str(SPEC_TIMESTAMP), "webhook-signature": SPEC_SIGNATURE}
    now = SPEC_TIMESTAMP + 1
    with pytest.raises(InvalidSignature, match="no webhook-signature matches"):
        verify(SPEC_SECRET, headers, SPEC_BODY + b" ", now=now)
    with pytest.raises(InvalidSignature, match="no webhook-signature matches"):
        verify(SECRET, headers, SPEC_BODY, now=now)
    with pytest.raises(InvalidSignature, match="no webhook-signature matches"):
        verify(SPEC_SECRET, {**headers, "webhook-id": "msg_other"}, SPEC_BODY, now=now)
    with pytest.raises(InvalidSignature, match="tolerance"):
        verify(SPEC_SECRET, headers, SPEC_BODY, now=SPEC_TIMESTAMP + 301)
    with pytest.raises(InvalidSignature, match="missing"):
        verify(SPEC_SECRET, {"webhook-id": SPEC_ID}, SPEC_BODY, now=now)
    # a rotation: several signatures, one of them ours
    rotated = {**headers, "webhook-signature": f"v1,bm90IGl0 {SPEC_SIGNATURE}"}
    assert verify(SPEC_SECRET, rotated, SPEC_BODY, now=now) == SPEC_ID


@pytest.mark.parametrize(("text", "problem"), [
    ("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "must start with 'whsec_'"),
    ("whsec_not base64!", "not valid base64"),
    ("whsec_c2hvcnQ=", "holds 5 bytes"),
    ("", "must start with"),
])
def test_a_bad_secret_is_refused_without_being_shown(text: str, problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem) as info:
        WebhookSecret(text)
    if len(text) > 8:
        assert text.removeprefix("whsec_") not in str(info.value)


def test_the_secret_is_never_shown(tmp_path: Path) -> None:
    secret = WebhookSecret(SPEC_SECRET)
    assert "MfKQ" not in repr(secret) and "MfKQ" not in str(secret)
    assert "MfKQ" not in repr(WebhookSink("https://example.com/", secret))
    # an error that happens to carry it (a receiver echoing it back) is masked by the error describer
    assert "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw" not in describe_error(RuntimeError(f"echo {SPEC_SECRET}"))
    assert "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw" not in excerpt(f"you sent {SPEC_SECRET}".encode())
    path = tmp_path / "secret"
    path.write_text(SPEC_SECRET + "\n")
    assert WebhookSecret.from_file(path).signature(SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE
    with pytest.raises(ConfigurationError, match="cannot read the webhook secret file"):
        WebhookSecret.from_file(tmp_path / "missing")


# -- the request


def test_a_delivery_is_a_signed_cloudevent_in_binary_mode(receiver: Receiver) -> None:
    sink = sink_for(receiver, source="/billing/relay")
    e = event(key="clé 1/%", headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    assert sink.deliver(e) == Delivered()
    [got] = receiver.received
    assert got.verified == str(e.id)
    assert got.path == "/hooks/outbox?tenant=t1"
    assert got.body == e.payload_json.encode()  # as stored, byte for byte
    h = got.headers
    assert h["content-type"] == "application/json"
    assert h["ce-specversion"] == "1.0"
    assert h["ce-id"] == h["webhook-id"] == str(e.id)
    assert h["ce-source"] == "/billing/relay"
    assert h["ce-type"] == "order.placed"
    assert h["ce-time"] == "2026-11-26T04:00:01.250000Z"
    assert h["ce-partitionkey"] == "cl%C3%A9%201/%25"  # percent-encoded as the CloudEvents HTTP binding says
    assert h["ce-schemaversion"] == "2"
    assert h["ce-topic"] == "orders"
    assert h["traceparent"] == e.headers["traceparent"]
    assert abs(int(h["webhook-timestamp"]) - time.time()) < 5
    sink.close()


def test_reserved_event_headers_are_left_out_and_bad_ones_dead_letter(receiver: Receiver) -> None:
    sink = sink_for(receiver)
    assert sink.deliver(event(headers={"ce-id": "forged", "webhook-id": "forged", "x-tenant": "t1"})) == Delivered()
    [got] = receiver.received
    assert got.headers["ce-id"] != "forged" and got.headers["webhook-id"] != "forged"
    assert got.headers["x-tenant"] == "t1"
    bad = sink.deliver(event(headers={"x-a": "line\r\nx-injected: 1"}))
    assert isinstance(bad, GiveUp) and "line break" in bad.reason
    bad = sink.deliver(event(headers={"bad name": "v"}))
    assert isinstance(bad, GiveUp) and "not a valid HTTP header name" in bad.reason
    assert len(receiver.received) == 1


def test_one_keep_alive_connection_per_thread(receiver: Receiver) -> None:
    sink = sink_for(receiver)
    for _ in range(5):
        assert sink.deliver(event()) == Delivered()
    assert {r.connection for r in receiver.received} == {1}
    sink.close()


@pytest.mark.parametrize("tls", [False, True])
def test_a_connection_the_server_closed_while_idle_is_replaced(tls: bool, certs: dict[str, Path]) -> None:
    # The server answers, then closes the connection without saying so (no "Connection: close", as an
    # idle timeout does): the next request on it fails before it is answered and is sent again on a new one.
    with receiving(lambda _r, n: Reply(hang_up=True), tls=server_tls(certs) if tls else None) as receiver:
        sink = sink_for(receiver, ca_file=certs["server_cert"]) if tls else sink_for(receiver)
        assert sink.deliver(event()) == Delivered()
        time.sleep(0.2)  # the server's close has arrived
        assert sink.deliver(event()) == Delivered()
        assert len(receiver.received) == 2 and len({r.connection for r in receiver.received}) == 2


class Recording:
    """A socket whose writes (``sendall`` and ``send`` calls) are recorded."""

    def __init__(self, sock: Any, writes: list[bytes]) -> None:
        self._sock = sock
        self._writes = writes

    def sendall(self, data: Any, *args: Any) -> Any:
        self._writes.append(bytes(data))
        return self._sock.sendall(data, *args)

    def send(self, data: Any, *args: Any) -> Any:
        self._writes.append(bytes(data))
        return self._sock.send(data, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


@pytest.mark.parametrize("tls", [False, True])
def test_a_request_goes_out_in_one_write(tls: bool, certs: dict[str, Path]) -> None:
    # http.client writes the headers and the body apart; behind Nagle's algorithm and the receiver's delayed
    # ACK the second write can wait about 40 ms on some stacks. One write: headers and body together.
    with receiving(tls=server_tls(certs) if tls else None) as receiver:
        sink = sink_for(receiver, ca_file=certs["server_cert"]) if tls else sink_for(receiver)
        conn, _ = sink._connection(False)
        writes: list[bytes] = []
        conn.sock = Recording(conn.sock, writes)
        payload = json.dumps({"n": 1, "text": "x" * 3000})
        assert sink.deliver(event(payload=payload)) == Delivered()
        [received] = receiver.received
    assert len(writes) == 1, [w[:40] for w in writes]
    head, _, body = writes[0].partition(b"\r\n\r\n")
    assert body == payload.encode() == received.body
    assert head.startswith(b"POST /hooks/outbox?tenant=t1 HTTP/1.1\r\n")
    assert f"content-length: {len(body)}\r\n".encode() in head.lower() + b"\r\n"


# -- the outcomes


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_retriable_statuses_retry(status: int) -> None:
    with receiving(lambda _r, _n: Reply(status, body=b"busy")) as receiver:
        outcome = sink_for(receiver).deliver(event())
    assert isinstance(outcome, Retry), outcome
    assert f"HTTP {status}" in outcome.reason and "busy" in outcome.reason and outcome.after_seconds is None


def test_retry_after_in_seconds_and_as_a_date() -> None:
    with receiving(lambda _r, _n: Reply(429, {"Retry-After": "7"})) as receiver:
        outcome = sink_for(receiver).deliver(event())
    assert outcome == Retry(outcome.reason, 7.0) if isinstance(outcome, Retry) else False
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=120), usegmt=True)
    with receiving(lambda _r, _n: Reply(503, {"Retry-After": later})) as receiver:
        outcome = sink_for(receiver).deliver(event())
    assert isinstance(outcome, Retry) and outcome.after_seconds is not None and 110 < outcome.after_seconds <= 120
    assert parse_retry_after("garbage") is None
    assert parse_retry_after("99999999") == 3600.0
    assert parse_retry_after(format_datetime(datetime(2000, 1, 1, tzinfo=UTC), usegmt=True)) == 0.0


def test_other_4xx_give_up_with_a_bounded_escaped_excerpt() -> None:
    body = ("<html>\n\x1b[31mnope\x1b[0m \"quoted\" " + "x" * 5000).encode()
    with receiving(lambda _r, _n: Reply(422, body=body)) as receiver:
        outcome = sink_for(receiver).deliver(event())
    assert isinstance(outcome, GiveUp)
    assert outcome.reason.startswith(f"POST http://localhost:{receiver.port}/hooks/outbox: HTTP 422 Unprocessable")
    assert "tenant" not in outcome.reason  # the query string (it may carry a token) is not shown
    assert "\\n\\u001b[31mnope" in outcome.reason and '\\"quoted\\"' in outcome.reason
    assert "\n" not in outcome.reason and "\x1b" not in outcome.reason
    assert len(outcome.reason) < 600 and outcome.reason.endswith("...")


def test_401_and_403_hold_the_sink_unless_told_otherwise() -> None:
    with receiving(lambda _r, _n: Reply(401, {"Retry-After": "12"}, b"bad signature")) as receiver:
        with pytest.raises(SinkUnavailable) as info:
            sink_for(receiver).deliver(event())
        assert info.value.retry_after_seconds == 12.0 and "HTTP 401" in str(info.value)
        outcome = sink_for(receiver, hold_statuses=()).deliver(event())
        assert isinstance(outcome, GiveUp) and "HTTP 401" in outcome.reason


def test_redirects_are_not_followed() -> None:
    with receiving() as target, receiving(lambda _r, _n: Reply(307, {"Location": target.url})) as receiver:
        with pytest.raises(SinkUnavailable, match=r"redirect to http://localhost:.*not followed"):
            sink_for(receiver).deliver(event())
        assert target.received == []


def test_a_slow_receiver_times_out_and_the_event_is_retried() -> None:
    with receiving(lambda _r, _n: Reply(delay=2.0)) as receiver:
        sink = sink_for(receiver, timeout_seconds=0.3)
        start = time.monotonic()
        outcome = sink.deliver(event())
        took = time.monotonic() - start
        assert isinstance(outcome, Retry) and "no response within 0.3s" in outcome.reason
        assert took < 1.5
        receiver.wait_for(lambda got: len(got) == 1)  # the slow request did reach it (so: dedupe by id)
        # the timed-out connection was dropped: the next delivery gets a new one and an answer
        receiver.respond = lambda _r, _n: Reply()
        assert sink.deliver(event()) == Delivered()


def test_a_connection_cut_after_the_request_is_retried() -> None:
    with receiving(lambda _r, n: Reply(close=True) if n == 1 else Reply()) as receiver:
        sink = sink_for(receiver)
        e = event()
        outcome = sink.deliver(e)
        assert isinstance(outcome, Retry) and "connection lost" in outcome.reason
        assert sink.deliver(e) == Delivered()


def test_a_receiver_that_is_down_holds_the_sink() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once closed
    sink = WebhookSink(f"http://127.0.0.1:{port}/", SECRET, connect_timeout_seconds=1.0)
    with pytest.raises(SinkUnavailable, match="can not connect: ConnectionRefusedError"):
        sink.deliver(event())


# -- TLS


@pytest.fixture(name="certs", scope="module")
def certs_fixture(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("certs")
    server_cert, server_key = self_signed(d, "server")
    client_cert, client_key = self_signed(d, "client", cn="relay")
    return {"server_cert": server_cert, "server_key": server_key, "client_cert": client_cert,
            "client_key": client_key}


def server_tls(certs: dict[str, Path], client_ca: Path | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs["server_cert"], certs["server_key"])
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca)
    return context


def test_tls_with_a_self_signed_certificate(certs: dict[str, Path]) -> None:
    with receiving(tls=server_tls(certs)) as receiver:
        assert receiver.url.startswith("https://")
        with pytest.raises(SinkUnavailable, match="TLS certificate does not verify"):
            sink_for(receiver).deliver(event())  # verification is on by default
        assert sink_for(receiver, ca_file=certs["server_cert"]).deliver(event()) == Delivered()
        assert sink_for(receiver, verify_tls=False).deliver(event()) == Delivered()
        assert len(receiver.received) == 2 and all(r.verified for r in receiver.received)


def test_mutual_tls_passes_the_client_certificate(certs: dict[str, Path]) -> None:
    with receiving(tls=server_tls(certs, client_ca=certs["client_cert"])) as receiver:
        sink = sink_for(receiver, ca_file=certs["server_cert"], client_cert=certs["client_cert"],
                        client_key=certs["client_key"])
        assert sink.deliver(event()) == Delivered()
        # Without it the server refuses: with TLS 1.3 after the handshake (an alert, or an EOF first,
        # whichever wins the race), so only "not delivered" is certain here.
        with contextlib.suppress(SinkUnavailable):
            assert not isinstance(sink_for(receiver, ca_file=certs["server_cert"]).deliver(event()), Delivered)
        assert len(receiver.received) == 1
    tls12 = server_tls(certs, client_ca=certs["client_cert"])
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    # refused in the handshake: the sink is held
    with receiving(tls=tls12) as receiver, pytest.raises(SinkUnavailable, match="can not connect"):
        sink_for(receiver, ca_file=certs["server_cert"]).deliver(event())


def test_unusable_tls_files_are_a_start_up_error(tmp_path: Path, certs: dict[str, Path]) -> None:
    with pytest.raises(ConfigurationError, match="webhook TLS files are not usable"):
        WebhookSink("https://example.com/", SECRET, ca_file=tmp_path / "missing.pem")
    with pytest.raises(ConfigurationError, match="need an https:// URL"):
        WebhookSink("http://example.com/", SECRET, ca_file=certs["server_cert"])


# -- configuration


@pytest.mark.parametrize(("url", "problem"), [
    ("ftp://example.com/", "must start with http:// or https://"),
    ("example.com/hook", "must start with http:// or https://"),
    ("https:///hook", "has no host"),
    ("https://user:hunter2@example.com/", "must not hold user:password@"),
    ("https://example.com:99999/", "not a URL"),
    ("https://example.com/a b", "whitespace"),
])
def test_a_bad_url_is_a_start_up_error(url: str, problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem) as info:
        WebhookSink(url, SECRET)
    assert "hunter2" not in str(info.value)
    with pytest.raises(ConfigurationError, match=problem) as info:
        load_settings(dsn="postgresql://x@h/db", webhook_url=url, webhook_secret=SECRET)
    assert "--webhook-url" in str(info.value) and "hunter2" not in str(info.value)


def test_settings_need_one_secret_and_never_show_it(tmp_path: Path) -> None:
    url = "https://example.com/hook"
    with pytest.raises(ConfigurationError, match="needs a signing secret"):
        load_settings(dsn="postgresql://x@h/db", webhook_url=url)
    path = tmp_path / "secret"
    path.write_text(SECRET)
    with pytest.raises(ConfigurationError, match="not both"):
        load_settings(dsn="postgresql://x@h/db", webhook_url=url, webhook_secret=SECRET, webhook_secret_file=path)
    with pytest.raises(ConfigurationError, match="webhook_secret") as info:
        load_settings(dsn="postgresql://x@h/db", webhook_url=url, webhook_secret="whsec_" + "A" * 10)
    assert "AAAAAAAAAA" not in str(info.value)
    with pytest.raises(ConfigurationError, match="cannot read the webhook secret file"):
        load_settings(dsn="postgresql://x@h/db", webhook_url=url, webhook_secret_file=tmp_path / "missing")
    (tmp_path / "bad").write_text("whsec_" + "B" * 10)
    with pytest.raises(ConfigurationError, match=r"OUTBOX_WEBHOOK_SECRET\)|not valid base64|bytes") as info:
        load_settings(dsn="postgresql://x@h/db", webhook_url=url, webhook_secret_file=tmp_path / "bad")
    assert "BBBBBBBBBB" not in str(info.value)
    s = load_settings(dsn="postgresql://x@h/db", webhook_url=url, webhook_secret_file=path, webhook_topics="a, b",
                      kafka=False)
    assert s.sinks == ["webhook"]
    assert SECRET not in repr(s) and SECRET not in str(s.model_dump())
    sink = from_settings(s)
    _made.append(sink)
    assert (sink.name, sink.endpoint, sink.topics, sink.concurrency) == ("webhook", url, frozenset({"a", "b"}), 4)


def test_from_env(monkeypatch: pytest.MonkeyPatch, receiver: Receiver) -> None:
    monkeypatch.setenv("OUTBOX_WEBHOOK_URL", receiver.url)
    monkeypatch.setenv("OUTBOX_WEBHOOK_SECRET", SECRET)
    monkeypatch.setenv("OUTBOX_WEBHOOK_CONCURRENCY", "8")
    monkeypatch.setenv("OUTBOX_WEBHOOK_TOPICS", "orders,payments")
    monkeypatch.setenv("OUTBOX_SOURCE", "/shop")
    sink = from_env()
    _made.append(sink)
    assert (sink.concurrency, sink.topics, sink.source) == (8, frozenset({"orders", "payments"}), "/shop")
    assert sink.deliver(event()) == Delivered()
    assert receiver.received[0].verified and receiver.received[0].headers["ce-source"] == "/shop"
    monkeypatch.setenv("OUTBOX_WEBHOOK_URL", "gopher://x")
    with pytest.raises(ConfigurationError, match=r"webhook_url \(--webhook-url, OUTBOX_WEBHOOK_URL\): .*http://"):
        from_env()
    monkeypatch.delenv("OUTBOX_WEBHOOK_URL")
    with pytest.raises(ConfigurationError, match="no webhook URL"):
        from_env()


def test_the_sink_option_loads_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # outbox-relay run --sink outbox_relay.webhook:from_env: the factory is called, the result checked
    from outbox_relay.compose import load_sink

    monkeypatch.setenv("OUTBOX_WEBHOOK_URL", "https://example.com/hook")
    monkeypatch.setenv("OUTBOX_WEBHOOK_SECRET", SECRET)
    sink = load_sink("outbox_relay.webhook:from_env")
    assert isinstance(sink, WebhookSink) and (sink.name, sink.kind) == ("webhook", "webhook")


def test_generating_a_secret(capsys: pytest.CaptureFixture[str]) -> None:
    from outbox_relay.webhook import main

    assert main(["secret"]) == 0
    text = capsys.readouterr().out.strip()
    assert text.startswith("whsec_") and WebhookSecret(text).signature("a", 1, b"") != WebhookSecret(
        WebhookSecret.generate()).signature("a", 1, b"")


def test_the_two_settings_models_agree() -> None:
    # RelaySettings (outbox-relay run --webhook-*) and WebhookSettings (from_env) share each field
    ours = {n: f for n, f in RelaySettings.model_fields.items() if n.startswith("webhook_")}
    theirs = {n: f for n, f in WebhookSettings.model_fields.items() if n.startswith("webhook_")}
    assert len(ours) == 12 and ours.keys() == theirs.keys()
    for name, field in ours.items():
        assert repr(field) == repr(theirs[name]), name


def test_payload_json_is_sent_as_stored(receiver: Receiver) -> None:
    stored = '{"b": 1, "a": [1.50, "\\u00e9"]}'  # what jsonb gave back: not re-serialised
    sink_for(receiver).deliver(event(payload=stored))
    assert receiver.received[0].body == stored.encode()
    assert json.loads(receiver.received[0].body) == {"b": 1, "a": [1.5, "é"]}
