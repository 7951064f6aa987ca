"""Standard Webhooks signing: the secret (``whsec_`` + base64), a message's signature, and ``verify`` for
receivers (who dedupe by ``webhook-id``, the event id: the same on every attempt and redelivery)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import time
from collections.abc import Mapping
from pathlib import Path

from ...dsn import remember_secret
from ...errors import ConfigurationError, OutboxError

SECRET_PREFIX = "whsec_"
MIN_SECRET_BYTES = 24  # Standard Webhooks: 24 to 64 random bytes
MAX_SECRET_BYTES = 64
TOLERANCE_SECONDS = 300  # how far a receiver accepts webhook-timestamp from its clock (replay window)


class InvalidSignature(OutboxError):
    """A webhook's signature did not verify (missing header, stale timestamp, no matching signature)."""



class WebhookSecret:
    """A Standard Webhooks signing secret, ``whsec_`` + base64 of 24-64 random bytes.

    Never shown: ``repr`` and ``str`` say only that it is a secret, errors never quote it, and the
    text is added to the values ``describe_error`` / log redaction masks.
    """

    __slots__ = ("_key",)

    def __init__(self, text: str) -> None:
        text = text.strip()
        if text:
            remember_secret(text)
        if not text.startswith(SECRET_PREFIX):
            raise ConfigurationError(f"the webhook secret must start with {SECRET_PREFIX!r} (Standard Webhooks: "
                                     f"{SECRET_PREFIX}<base64 of {MIN_SECRET_BYTES}-{MAX_SECRET_BYTES} random bytes>; "
                                     "make one with `python -m outbox_relay.webhook secret`)")
        encoded = text[len(SECRET_PREFIX):]
        remember_secret(encoded)
        try:
            key = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigurationError(f"the webhook secret is not {SECRET_PREFIX}<base64>: the part after "
                                     f"{SECRET_PREFIX!r} is not valid base64") from None
        if not MIN_SECRET_BYTES <= len(key) <= MAX_SECRET_BYTES:
            raise ConfigurationError(f"the webhook secret holds {len(key)} bytes; Standard Webhooks asks for "
                                     f"{MIN_SECRET_BYTES}-{MAX_SECRET_BYTES}")
        self._key = key

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> WebhookSecret:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"cannot read the webhook secret file {str(path)!r}: "
                                     f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
        return cls(text)

    @classmethod
    def generate(cls) -> str:
        """A new secret's text (32 random bytes)."""
        return SECRET_PREFIX + base64.b64encode(os.urandom(32)).decode()

    def signature(self, msg_id: str, timestamp: int, body: bytes) -> str:
        """The ``v1,<base64>`` signature of one message."""
        signed = f"{msg_id}.{timestamp}.".encode() + body
        return "v1," + base64.b64encode(hmac.new(self._key, signed, hashlib.sha256).digest()).decode()

    def __repr__(self) -> str:
        return "WebhookSecret('***')"

    __str__ = __repr__

    def __reduce__(self) -> str | tuple[object, ...]:  # no pickling a secret into a traceback or a queue by accident
        raise TypeError("a WebhookSecret can not be pickled")


def as_secret(secret: WebhookSecret | str) -> WebhookSecret:
    return secret if isinstance(secret, WebhookSecret) else WebhookSecret(secret)


def verify(secret: WebhookSecret | str, headers: Mapping[str, str], body: bytes, *,
           tolerance_seconds: float = TOLERANCE_SECONDS, now: float | None = None) -> str:
    """Check a received webhook; returns its ``webhook-id`` (dedupe by it), or raises InvalidSignature.

    ``headers`` is looked up without regard to case (a dict, ``http.client.HTTPMessage``, a framework's
    headers); ``body`` is the raw request body, before any JSON parsing. A timestamp further than
    ``tolerance_seconds`` from ``now`` is refused (replays of captured requests).
    """
    key = as_secret(secret)
    lowered = {k.lower(): v for k, v in headers.items()}
    msg_id = lowered.get("webhook-id")
    stamp = lowered.get("webhook-timestamp")
    signatures = lowered.get("webhook-signature")
    if not msg_id or not stamp or not signatures:
        raise InvalidSignature("missing webhook-id, webhook-timestamp or webhook-signature header")
    try:
        timestamp = int(stamp)
    except ValueError:
        raise InvalidSignature("webhook-timestamp is not an integer") from None
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_seconds:
        raise InvalidSignature(f"webhook-timestamp is {current - timestamp:+.0f}s from now (tolerance "
                               f"{tolerance_seconds:g}s)")
    expected = key.signature(msg_id, timestamp, body).encode()
    # Several space-separated signatures may come (a secret being rotated): one match is enough.
    if any(hmac.compare_digest(expected, s.encode()) for s in signatures.split() if s.startswith("v1,")):
        return msg_id
    raise InvalidSignature("no webhook-signature matches the body")

