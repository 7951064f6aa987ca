"""The webhook sink: one signed HTTP POST per event (an ``EventSink``), and ``verify`` for receivers.

``sink.py`` (``WebhookSink``, ``from_settings``, ``from_env``), ``signing.py`` (Standard Webhooks secret,
signature, ``verify``), ``connection.py`` (the URL's checks, TLS, the HTTP connection and its deadline),
``responses.py`` (``Retry-After``, safe excerpts of an answer).
"""

from .connection import check_url
from .responses import excerpt, parse_retry_after
from .signing import InvalidSignature, WebhookSecret, verify
from .sink import WebhookSink, from_env, from_settings

__all__ = ["InvalidSignature", "WebhookSecret", "WebhookSink", "check_url", "excerpt", "from_env", "from_settings",
           "parse_retry_after", "verify"]
