"""A real HTTP(S) webhook receiver for the tests: http.server in a thread, scripted per request.

It verifies every request's signature with ``outbox_relay.webhook.verify`` (the helper receivers
use) and records what it got; ``respond`` decides each answer (status, headers, body, delay).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import hmac
import json
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from outbox_relay.webhook import InvalidSignature, WebhookSecret, verify

SECRET = WebhookSecret.generate()


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    at: float
    verified: str | None  # the webhook-id if the signature verified, else None
    connection: int  # which TCP connection it came on (1, 2, ...)
    status: int | None = None  # what the receiver answered (None: it cut the connection)

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def id(self) -> str:
        return self.headers["webhook-id"]

    @property
    def key(self) -> str:
        return self.headers["ce-partitionkey"]

    @property
    def payload(self) -> Any:
        return json.loads(self.body)


@dataclass
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    delay: float = 0.0  # seconds before answering
    close: bool = False  # close the connection without answering
    hang_up: bool = False  # answer, then close the connection without saying so (an idle timeout)


def spec_signature_matches(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """Standard Webhooks checked from the specification's words, independently of outbox_relay.webhook:
    HMAC-SHA256 keyed with base64-decoded secret after ``whsec_``, over ``id.timestamp.body``."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    content = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = "v1," + base64.b64encode(hmac.new(key, content, hashlib.sha256).digest()).decode()
    return expected in headers["webhook-signature"].split(" ")


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up (a timeout, a killed relay) is part of the tests, not news


Respond = Callable[[Received, int], Reply]  # (request, how many times this webhook-id was seen) -> reply


class Receiver:
    def __init__(self, respond: Respond | None = None, secret: str = SECRET,
                 tls: ssl.SSLContext | None = None, port: int = 0) -> None:
        self.respond: Respond = respond or (lambda _r, _n: Reply())
        self.secret = secret
        self.received: list[Received] = []
        self.seen: dict[str, int] = {}
        self.connections = 0
        self.lock = threading.RLock()  # wait_for predicates call ok_ids() under it
        self.got = threading.Condition(self.lock)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive

            def setup(self) -> None:
                super().setup()
                with receiver.lock:
                    receiver.connections += 1
                    self.number = receiver.connections

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    verified: str | None = verify(receiver.secret, headers, body)
                except InvalidSignature:
                    verified = None
                if verified is not None and not spec_signature_matches(receiver.secret, headers, body):
                    verified = None  # verify() and the sink agree with each other, but not with the scheme
                request = Received(self.path, headers, body, time.monotonic(), verified, self.number)
                with receiver.lock:
                    seen = receiver.seen.get(headers.get("webhook-id", ""), 0) + 1
                    receiver.seen[headers.get("webhook-id", "")] = seen
                reply = receiver.respond(request, seen)
                if reply.delay:
                    time.sleep(reply.delay)
                with receiver.got:
                    receiver.received.append(dataclasses.replace(request, status=None if reply.close else reply.status))
                    receiver.got.notify_all()
                if reply.close:
                    self.close_connection = True
                    return
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)
                if reply.hang_up:
                    self.close_connection = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = _QuietServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.scheme = "https" if tls is not None else "http"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"{self.scheme}://localhost:{self.port}/hooks/outbox?tenant=t1"

    def start(self) -> Receiver:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, done: Callable[[list[Received]], bool], timeout: float = 30.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        with self.got:
            while not done(self.received):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"receiver: condition not met in {timeout}s; got {len(self.received)}")
                self.got.wait(left)
            return list(self.received)

    def ok_ids(self) -> set[str]:
        """The webhook-ids answered 2xx at least once (what the receiver applied, deduped)."""
        with self.lock:
            return {r.id for r in self.received if r.ok and r.verified}

    def accepted(self) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.ok]


@contextlib.contextmanager
def receiving(respond: Respond | None = None, **kwargs: Any) -> Iterator[Receiver]:
    receiver = Receiver(respond, **kwargs).start()
    try:
        yield receiver
    finally:
        receiver.stop()


def self_signed(directory: Path, name: str, cn: str = "localhost") -> tuple[Path, Path]:
    """A self-signed certificate and key (PEM) for ``cn``, made with the openssl command."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={cn}",
                    "-addext", f"subjectAltName=DNS:{cn},IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key
