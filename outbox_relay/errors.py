"""Every error the package raises on purpose derives from OutboxError."""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of outbox-relay errors."""


class InvalidEvent(OutboxError, ValueError):
    """An event was refused before anything was written; the message names the field."""


class ConfigurationError(OutboxError, ValueError):
    """A setting, sink name or projection reference is not usable."""


class SchemaError(OutboxError):
    """The database schema is missing or newer than this version understands."""


class LeaseLost(OutboxError):
    """This worker no longer holds the bucket; its work there was discarded (fencing)."""


class NonRetriableDelivery(OutboxError):
    """A sink says this event can never be delivered (e.g. too large): dead-letter at once."""
