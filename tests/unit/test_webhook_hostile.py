"""The webhook sink against hostile receivers and URLs, called directly (``deliver``) against a real
TCP server in a thread that speaks (or half-speaks) HTTP as scripted: a call always ends within the
sink's timeout with an answer that names the problem, and a bad URL is refused at start-up."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from outbox_relay.errors import ConfigurationError
from outbox_relay.settings import load_settings
from outbox_relay.sinks import Delivered, GiveUp, Retry
from outbox_relay.sinks.webhook import WebhookSink, parse_retry_after
from tests.unit.test_webhook import event
from tests.webhook_receiver import SECRET

Script = Callable[[socket.socket], None]  # runs on the accepted connection after the request was read


@contextlib.contextmanager
def raw_receiver(script: Script) -> Iterator[str]:
    """A TCP server that reads one request's head and body, then runs ``script`` on the connection."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                while len(body) < length:
                    body += conn.recv(65536)
                with contextlib.suppress(OSError):
                    script(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}/hook"
    finally:
        stop.set()
        thread.join(15)
        server.close()


def trickle(*, head: bytes = b"", chunk: bytes, every: float = 0.1, seconds: float = 6.0) -> Script:
    """Send ``head``, then ``chunk`` every ``every`` seconds for ``seconds``: each read of the client
    gets data well within its timeout, but the response never ends."""
    def script(conn: socket.socket) -> None:
        conn.sendall(head)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(chunk)
            time.sleep(every)
    return script


@pytest.mark.parametrize(("script", "answer"), [
    # headers that never end
    (trickle(head=b"HTTP/1.1 200 OK\r\n", chunk=b"X-A: b\r\n"), Retry),
    # interim 100 responses without end
    (trickle(chunk=b"HTTP/1.1 100 Continue\r\n\r\n"), Retry),
    # a status line, one byte at a time
    (trickle(chunk=b"H", every=0.05), Retry),
    # a refusal whose body trickles: the status decides, the body is left
    (trickle(head=b"HTTP/1.1 400 Bad Request\r\nContent-Length: 1000000000\r\n\r\n", chunk=b"x"), GiveUp),
    # an acceptance whose body trickles
    (trickle(head=b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n", chunk=b"x"), Delivered),
], ids=["endless-headers", "endless-100-continue", "slow-status-line", "slow-4xx-body", "slow-2xx-body"])
def test_a_response_that_never_ends_is_cut_at_the_timeout(script: Script, answer: type) -> None:
    with raw_receiver(script) as url:
        sink = WebhookSink(url, SECRET, timeout_seconds=1.0)
        try:
            start = time.monotonic()
            outcome = sink.deliver(event())
            took = time.monotonic() - start
        finally:
            sink.close()
    assert isinstance(outcome, answer), outcome
    assert took < 3.0, f"the call took {took:.1f}s with a 1s timeout"
    if isinstance(outcome, Retry):
        assert "no response within 1s" in outcome.reason, outcome.reason


def test_a_garbage_status_line_is_retried_with_its_text_escaped() -> None:
    line = b"\x1b[2J\x1b]0;pwned\x07 HTTP/9 nonsense\r\n\r\n"
    with raw_receiver(lambda conn: conn.sendall(line)) as url:
        sink = WebhookSink(url, SECRET, timeout_seconds=2.0)
        try:
            outcome = sink.deliver(event())
        finally:
            sink.close()
    assert isinstance(outcome, Retry), outcome
    assert "\x1b" not in outcome.reason and "\x07" not in outcome.reason and "\\u001b[2J" in outcome.reason


def test_retry_after_that_is_not_ascii_digits_is_ignored() -> None:
    for value in ("\u00b2", "\u0661\u0662", "1.5", "-3", "NaN", "inf", "", " "):
        assert parse_retry_after(value) is None, value
    assert parse_retry_after(" 12 ") == 12.0


@pytest.mark.parametrize(("url", "problem"), [
    ("https://example.com/hooks/caf\u00e9", "not ASCII"),
    ("https://example.com/hooks?tenant=\u00e9t\u00e9", "not ASCII"),
    ("https://example.com/a\x01b", "control character"),
    ("https://example.com/a\x7fb", "control character"),
    ("https://example.com/?t=a\x00b", "control character"),
    ("https://exa\x1bmple.com/", "control character"),
])
def test_a_url_http_can_not_send_is_a_start_up_error(url: str, problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        WebhookSink(url, SECRET)
    with pytest.raises(ConfigurationError, match=problem) as info:
        load_settings(dsn="postgresql://x@h/db", webhook_url=url, webhook_secret=SECRET)
    assert "--webhook-url" in str(info.value) and "tenant" not in str(info.value)


def test_a_header_name_ending_in_a_newline_dead_letters_and_spares_the_next_event() -> None:
    """`$` in a regex also matches before a final newline: 'X-Evil\\n' passed the token check, http.client
    then raised ValueError mid-request (retried, not dead-lettered) and left the kept-alive connection
    half-written, so the next, good event failed an attempt too."""
    from tests.webhook_receiver import receiving

    with receiving() as receiver:
        sink = WebhookSink(receiver.url, SECRET, timeout_seconds=5.0)
        try:
            assert sink.deliver(event()) == Delivered()  # a kept-alive connection
            bad = sink.deliver(event(headers={"X-Evil\n": "v"}))
            assert isinstance(bad, GiveUp) and "not a valid HTTP header name" in bad.reason, bad
            assert sink.deliver(event()) == Delivered()
        finally:
            sink.close()
