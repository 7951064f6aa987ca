"""The webhook sink's HTTP connections (standard library only): the URL's checks, TLS, one write per
request, and a response read within one deadline."""

from __future__ import annotations

import http.client
import io
import re
import socket
import ssl
import time
import urllib.parse
from pathlib import Path
from typing import Any

from ...errors import ConfigurationError

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_url(url: str) -> urllib.parse.SplitResult:
    """The parts of a webhook URL, or ConfigurationError saying what is wrong (never quoting it whole:
    its query may hold a token)."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ConfigurationError(f"the webhook URL is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigurationError("the webhook URL must start with http:// or https://")
    if not parts.hostname:
        raise ConfigurationError("the webhook URL has no host")
    if parts.username is not None or parts.password is not None:
        raise ConfigurationError("the webhook URL must not hold user:password@ (it would end up in logs); the "
                                 "signature authenticates the relay")
    if parts.fragment:
        raise ConfigurationError("the webhook URL must not have a #fragment")
    if any(c in url.strip() for c in " \r\n\t"):
        raise ConfigurationError("the webhook URL holds whitespace")
    # http.client refuses these in the request line or Host header on every request, which would turn a
    # configuration mistake into a retry, then a dead letter, of every event.
    if _CONTROL.search(url):
        raise ConfigurationError("the webhook URL holds a control character")
    if not (parts.path + parts.query).isascii():
        raise ConfigurationError("the webhook URL's path or query holds characters that are not ASCII: "
                                 "percent-encode them (e.g. caf%C3%A9)")
    return parts


def ssl_context(ca_file: Path | None, client_cert: Path | None, client_key: Path | None,
                 verify_tls: bool) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        if client_cert is not None:
            context.load_cert_chain(str(client_cert), str(client_key) if client_key else None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(f"webhook TLS files are not usable: {type(exc).__name__}: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None
    if not verify_tls:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class DeadlineReader(io.RawIOBase):
    """A response's bytes from ``sock``, every read bounded by what is left until ``deadline``: a socket
    timeout alone bounds each read, and a receiver that sends a byte now and then (headers that never
    end, endless ``100 Continue``, a trickled body) would hold the call forever."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the response did not end within the timeout")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class OneWriteConnection(http.client.HTTPConnection):
    """An ``HTTPConnection`` that writes a request's headers and body in one ``sendall``: http.client writes
    them apart, and behind Nagle's algorithm and the receiver's delayed ACK the body's write can wait up to
    about 40 ms on some stacks (a second small write waits for the ACK of the first)."""

    _body: bytes | None = None  # the body ``post`` is sending, written with the headers

    def post(self, target: str, body: bytes, headers: dict[str, str | bytes]) -> None:
        """``request("POST", ...)`` with the body sent with the headers (its Content-Length set here)."""
        self._body = body
        try:
            self.request("POST", target, None, {**headers, "content-length": str(len(body))})
        finally:
            self._body = None

    def send(self, data: Any) -> None:
        # http.client's one write of the headers (endheaders without a body): the body goes with it.
        body, self._body = self._body, None
        super().send(data + body if body else data)


class OneWriteTLSConnection(OneWriteConnection, http.client.HTTPSConnection):
    """``OneWriteConnection`` over TLS."""


class TimedResponse(http.client.HTTPResponse):
    """An ``HTTPResponse`` read through a ``DeadlineReader`` (status, headers and body alike)."""

    def __init__(self, sock: socket.socket, *args: Any, deadline: float, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        self.fp.close()  # the plain reader http.client made; the socket stays open
        self.fp = io.BufferedReader(DeadlineReader(sock, deadline))
