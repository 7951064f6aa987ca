"""The webhook sink: one signed HTTP POST per event.

Each event goes out in CloudEvents HTTP binary mode (``ce-*`` headers, the payload as the body, as
stored) and is signed per Standard Webhooks (``webhook-id``, ``webhook-timestamp``,
``webhook-signature``). The response decides the outcome: 2xx delivered; 408, 429 and 5xx retried
(honouring ``Retry-After``); other 4xx dead-lettered with the status and an excerpt of the body.
Ordering per key, concurrency across keys, retries, dead letters and fencing are the relay's (the
sink contract's adapter); this module only speaks HTTP. Standard library only (http.client + ssl):
one keep-alive connection per delivering thread is all a webhook needs.

Receivers verify with ``verify(secret, headers, body)`` (``signing.py``) and dedupe by ``webhook-id``
(the event id: the same on every attempt and redelivery).
"""

from __future__ import annotations

import functools
import http.client
import logging
import os
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from ... import __version__
from ...dsn import remember_secret
from ...errors import ConfigurationError
from ..cloudevents import CONTENT_TYPE, attributes, header_value
from ..user import MAX_CONCURRENCY, Delivered, GiveUp, Retry, SinkEvent, SinkUnavailable
from .connection import OneWriteConnection, OneWriteTLSConnection, TimedResponse, check_url, ssl_context
from .responses import excerpt, parse_retry_after, query_secrets
from .signing import WebhookSecret, as_secret

if TYPE_CHECKING:
    from ...webhook_settings import WebhookFields

log = logging.getLogger("outbox_relay.webhook")

RETRY_STATUSES = frozenset({408, 429})  # plus every 5xx
HOLD_STATUSES = frozenset({401, 403})  # the receiver refuses us, not the event: see WebhookSink
UNAVAILABLE_SECONDS = 5.0  # wait after a connection failure when the server said nothing
MAX_RESPONSE_BYTES = 64 * 1024  # read of a response body; a longer one closes the connection
USER_AGENT = f"outbox-relay/{__version__}"

# HTTP token (RFC 9110 5.6.2): what a header name may be.
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
# Header names the sink sets (lower-case), plus every ce-* and webhook-* name: an event's own header
# of such a name is left out (the receiver must be able to trust them).
_RESERVED = frozenset({"content-type", "content-length", "host", "user-agent", "connection", "transfer-encoding",
                       "te", "trailer", "upgrade", "keep-alive", "proxy-connection", "expect"})
_RESERVED_PREFIXES = ("ce-", "webhook-")




class WebhookSink:
    """POSTs each event to ``url``, signed with ``secret``. An ``EventSink`` (outbox_relay.sinks).

    Outcomes:

    - 2xx: delivered. Redirects are not followed: the signed request would go to a host the operator
      did not configure, and clients turn a redirected POST into a GET; a 3xx holds the sink (no
      attempt counted) with the ``Location`` in the reason, so the operator configures the final URL.
    - 408, 429, 5xx, a timeout or a connection lost after the request was sent: ``Retry`` after
      ``Retry-After`` if the response had one, else the relay's backoff (counts an attempt).
    - the connection can not be made (refused, DNS, TLS handshake, certificate): ``SinkUnavailable``
      (the request never reached the receiver, so it is not the event's fault: nothing is counted and
      no good event is dead-lettered while the receiver is down).
    - ``hold_statuses`` (401 and 403 unless told otherwise): the receiver refuses this relay (a rotated
      secret, a token, an ACL), a condition of the sink: ``SinkUnavailable`` too. Pass ``()`` to
      dead-letter them like other 4xx.
    - other 4xx (and 1xx, anything else): ``GiveUp`` with the status and an excerpt of the body.

    Thread-safe: each delivering thread keeps its own keep-alive connection.
    """

    kind = "webhook"

    def __init__(self, url: str, secret: WebhookSecret | str, *, name: str = "webhook",
                 source: str = "outbox-relay", connect_timeout_seconds: float = 5.0,
                 timeout_seconds: float = 30.0, concurrency: int = 4,
                 topics: Collection[str] | None = None, types: Collection[str] | None = None,
                 ca_file: str | os.PathLike[str] | None = None,
                 client_cert: str | os.PathLike[str] | None = None,
                 client_key: str | os.PathLike[str] | None = None, verify_tls: bool = True,
                 hold_statuses: Collection[int] = HOLD_STATUSES,
                 unavailable_seconds: float = UNAVAILABLE_SECONDS) -> None:
        self.name = name
        self.source = source
        self._secret = as_secret(secret)
        parts = check_url(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        self._target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        # What logs and reasons show: no query string (it may carry a token).
        self.endpoint = f"{parts.scheme}://{parts.netloc}{parts.path or '/'}"
        # A receiver may echo the request target ("Cannot POST /hook?token=..."): masked in every excerpt
        # of its answers, and the whole query in every log line (redact).
        self._hide = query_secrets(parts.query)
        if parts.query:
            remember_secret(parts.query)
            remember_secret(urllib.parse.unquote(parts.query))
        if not 0 < connect_timeout_seconds <= 3600 or not 0 < timeout_seconds <= 3600:
            raise ConfigurationError("webhook timeouts must be more than 0 and at most 3600 seconds")
        self.connect_timeout_seconds = connect_timeout_seconds
        self.timeout_seconds = timeout_seconds
        if not 1 <= concurrency <= MAX_CONCURRENCY:
            raise ConfigurationError(f"webhook concurrency must be 1-{MAX_CONCURRENCY} (keys delivered at once)")
        self.concurrency = concurrency
        self.topics = frozenset(topics) if topics is not None else None
        self.types = frozenset(types) if types is not None else None
        self.hold_statuses = frozenset(hold_statuses)
        if not 0 <= unavailable_seconds <= 3600:
            raise ConfigurationError("webhook unavailable_seconds must be 0-3600")
        self.unavailable_seconds = unavailable_seconds  # the wait after a failed connect (tests shrink it)
        if not self._https and (ca_file or client_cert or client_key or not verify_tls):
            raise ConfigurationError("webhook TLS settings (CA file, client certificate, verify off) need an "
                                     "https:// URL")
        if client_key and not client_cert:
            raise ConfigurationError("a webhook client key needs its client certificate")
        self._context = (ssl_context(Path(ca_file) if ca_file else None, Path(client_cert) if client_cert else None,
                                      Path(client_key) if client_key else None, verify_tls)
                         if self._https else None)
        if not verify_tls:
            log.warning("webhook sink %s: TLS certificate verification is OFF for %s", name, self.endpoint)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()  # every thread's connection, for close()

    def __repr__(self) -> str:
        return f"WebhookSink(name={self.name!r}, endpoint={self.endpoint!r})"

    # -- the contract

    def deliver(self, event: SinkEvent) -> Delivered | Retry | GiveUp:
        request = self._request(event)
        if isinstance(request, GiveUp):
            return request
        headers, body = request
        for fresh in (False, True):
            conn, reused = self._connection(fresh)
            try:
                assert conn.sock is not None
                conn.sock.settimeout(self.timeout_seconds)  # sending; the last response's read may have shrunk it
                # The whole response (status, headers, body) within timeout_seconds of sending the request.
                conn.response_class = functools.partial(  # type: ignore[assignment]
                    TimedResponse, deadline=time.monotonic() + self.timeout_seconds)
                conn.post(self._target, body, headers)  # one write: headers and body together
                response = conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                self._drop(conn)
                if reused and not fresh:
                    # A kept-alive connection the server closed while idle: that request never reached
                    # it. Send once more on a new one (the receiver dedupes by webhook-id if it did).
                    continue
                return Retry(f"POST {self.endpoint}: connection lost: {type(exc).__name__}: {exc}")
            except TimeoutError:
                self._drop(conn)
                return Retry(f"POST {self.endpoint}: no response within {self.timeout_seconds:g}s (read timeout)")
            except ssl.SSLError as exc:
                self._drop(conn)
                if isinstance(exc, ssl.SSLEOFError | ssl.SSLZeroReturnError):  # over TLS, a closed connection
                    if reused and not fresh:
                        continue
                    return Retry(f"POST {self.endpoint}: connection lost: {type(exc).__name__}: {exc}")
                # A TLS alert after the handshake (TLS 1.3 checks the client certificate then): the
                # server refuses this relay's TLS identity, a condition of the sink.
                raise SinkUnavailable(f"POST {self.endpoint}: TLS refused: {exc}", 30.0) from None
            except (OSError, http.client.HTTPException) as exc:
                self._drop(conn)
                # The message may quote what the receiver sent (a garbage status line): escaped, bounded.
                shown = excerpt(str(exc).encode(), hide=self._hide)
                return Retry(f"POST {self.endpoint}: {type(exc).__name__}: {shown}")
            except BaseException:
                self._drop(conn)  # a request cut short leaves the connection half-written: not for the next event
                raise
            return self._outcome(conn, response)
        raise AssertionError("unreachable")  # the loop returns

    def close(self) -> None:
        with self._lock:
            conns, self._open = self._open, set()
        for conn in conns:
            conn.close()

    # -- HTTP

    def _request(self, event: SinkEvent) -> tuple[dict[str, str | bytes], bytes] | GiveUp:
        body = event.payload_json.encode()
        msg_id = str(event.id)
        timestamp = int(time.time())
        headers: dict[str, str | bytes] = {}
        for name, value in event.headers.items():
            lowered = name.lower()
            if lowered in _RESERVED or lowered.startswith(_RESERVED_PREFIXES):
                log.warning("webhook sink %s: event %s has a header %r, a name the sink sets; sending the event "
                            "without it", self.name, event.id, name)
                continue
            if not _TOKEN.fullmatch(name):  # fullmatch: `$` would let a final newline through
                return GiveUp(f"the event's header {name[:100]!r} is not a valid HTTP header name")
            encoded = value.encode()
            if any(c in encoded for c in b"\r\n\0"):
                return GiveUp(f"the event's header {name!r} holds a line break or NUL (not allowed in HTTP)")
            headers[name] = encoded
        ce = attributes(event, self.source, event.topic)
        del ce["datacontenttype"]  # the content-type header
        topic = ce.pop("topic", None)  # sent last
        headers.update({
            "content-type": CONTENT_TYPE,
            "user-agent": USER_AGENT,
            **{f"ce-{name}": header_value(value) for name, value in ce.items()},
            "webhook-id": msg_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": self._secret.signature(msg_id, timestamp, body),
        })
        if topic is not None:
            headers["ce-topic"] = header_value(topic)
        return headers, body

    def _connection(self, fresh: bool) -> tuple[OneWriteConnection, bool]:
        """This thread's connection (a new one if ``fresh`` or none is open) and whether it was used before."""
        conn: OneWriteConnection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None and not fresh:
            return conn, True
        if conn is not None:
            self._drop(conn)
        if self._context is not None:
            conn = OneWriteTLSConnection(self._host, self._port, timeout=self.connect_timeout_seconds,
                                         context=self._context)
        else:
            conn = OneWriteConnection(self._host, self._port, timeout=self.connect_timeout_seconds)
        try:
            conn.connect()
        except ssl.SSLCertVerificationError as exc:
            conn.close()
            raise SinkUnavailable(f"POST {self.endpoint}: the server's TLS certificate does not verify: "
                                  f"{exc.verify_message or exc}", 30.0) from None
        except (OSError, ssl.SSLError) as exc:
            conn.close()
            what = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            raise SinkUnavailable(f"POST {self.endpoint}: can not connect: {what}", self.unavailable_seconds) from None
        assert conn.sock is not None
        conn.sock.settimeout(self.timeout_seconds)  # the connect timeout was for connecting only
        self._local.conn = conn
        with self._lock:
            self._open.add(conn)
        return conn, False

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            self._open.discard(conn)

    def _outcome(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse
                 ) -> Delivered | Retry | GiveUp:
        status = response.status
        try:
            data = response.read(MAX_RESPONSE_BYTES + 1)
            if len(data) > MAX_RESPONSE_BYTES or not response.isclosed():
                self._drop(conn)  # the rest was not read: the connection can not be reused
        except (OSError, http.client.HTTPException):
            # The status line arrived; a body cut short does not change the answer.
            self._drop(conn)
            data = b""
        if response.will_close:
            self._drop(conn)
        if 200 <= status < 300:
            return Delivered()
        what = f"POST {self.endpoint}: HTTP {status} {excerpt(response.reason.encode(), 100, self._hide)}"
        if data:
            what += f": {excerpt(data, hide=self._hide)}"
        retry_after = parse_retry_after(response.getheader("retry-after"))
        if status in RETRY_STATUSES or 500 <= status < 600:
            return Retry(what, retry_after)
        if 300 <= status < 400:
            location = response.getheader("location")
            where = f" to {excerpt(location.encode(), 200, self._hide)}" if location else ""
            raise SinkUnavailable(f"{what} (a redirect{where}, not followed: configure the final URL)",
                                  retry_after or 60.0)
        if status in self.hold_statuses:
            raise SinkUnavailable(f"{what} (the receiver refuses this relay: check the secret or credentials)",
                                  retry_after or 60.0)
        return GiveUp(what)


# -- configuration --------------------------------------------------------------------------------


def from_settings(settings: WebhookFields) -> WebhookSink:
    """The webhook sink that ``settings`` (``webhook_*``) describe; ConfigurationError without a URL."""
    s = settings
    if not s.webhook_url:
        raise ConfigurationError("no webhook URL: pass --webhook-url or set OUTBOX_WEBHOOK_URL")
    if s.webhook_secret_file is not None:
        secret = WebhookSecret.from_file(s.webhook_secret_file)
    elif s.webhook_secret is not None:
        secret = WebhookSecret(s.webhook_secret.get_secret_value())
    else:
        raise ConfigurationError("the webhook sink needs a signing secret: pass --webhook-secret-file PATH or set "
                                 "OUTBOX_WEBHOOK_SECRET (whsec_<base64>; make one with "
                                 "`python -m outbox_relay.webhook secret`)")
    return WebhookSink(s.webhook_url, secret, name=s.webhook_sink, source=s.source,
                       connect_timeout_seconds=s.webhook_connect_timeout_seconds,
                       timeout_seconds=s.webhook_timeout_seconds, concurrency=s.webhook_concurrency,
                       topics=s.webhook_topics or None, ca_file=s.webhook_ca_file,
                       client_cert=s.webhook_client_cert, client_key=s.webhook_client_key,
                       verify_tls=s.webhook_tls_verify)


def from_env() -> WebhookSink:
    """The webhook sink the ``OUTBOX_WEBHOOK_*`` variables describe: ``--sink outbox_relay.webhook:from_env``."""
    from pydantic import ValidationError

    from ...settings import describe_validation_error
    from ...webhook_settings import WebhookSettings

    try:
        settings = WebhookSettings()
    except ValidationError as exc:
        raise ConfigurationError(f"invalid webhook settings: {describe_validation_error(exc)}") from None
    return from_settings(settings)


__all__ = ["WebhookSink", "from_env", "from_settings"]
