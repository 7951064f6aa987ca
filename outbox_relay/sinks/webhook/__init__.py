"""The webhook sink: one signed HTTP POST per event (an ``EventSink``), and ``verify`` for receivers."""

from .sink import InvalidSignature, WebhookSecret, WebhookSink, check_url, from_env, from_settings, verify

__all__ = ["InvalidSignature", "WebhookSecret", "WebhookSink", "check_url", "from_env", "from_settings", "verify"]
