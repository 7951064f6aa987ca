"""The error of a rebuild (rebuild.py, key_rebuild.py): what it refused or why it stopped, nothing half done."""

from __future__ import annotations

from outbox_relay.errors import OutboxError


class RebuildError(OutboxError):
    """A rebuild can not start, resume or switch over; the message says why and what to do."""
