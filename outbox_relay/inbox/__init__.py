"""The consumer-side inbox: apply the relay's Kafka messages exactly once in a PostgreSQL database.

``outbox-relay inbox run --handler MODULE:ATTR --topic T`` runs ``InboxConsumer``; see docs/inbox.md.
"""

from __future__ import annotations

from .consumer import InboxConsumer
from .message import InboxMessage
from .schema import migrate_inbox
from .settings import InboxSettings, load_inbox_settings
from .store import Handler, HandlerTimeout
from .testing import apply_test_message, make_message

__all__ = [
    "Handler",
    "HandlerTimeout",
    "InboxConsumer",
    "InboxMessage",
    "InboxSettings",
    "apply_test_message",
    "load_inbox_settings",
    "make_message",
    "migrate_inbox",
]
