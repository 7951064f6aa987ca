"""outbox-relay: transactional outbox on PostgreSQL, relayed to Kafka in order per key.

Producers: ``Outbox().publish(conn, ...)`` inside the business transaction.
Relays: the ``outbox-relay`` command, or ``Worker(RelaySettings(...)).run()``.
"""

from .errors import ConfigurationError, IdempotencyConflict, InvalidEvent, OutboxError, SchemaError
from .event import Event
from .migrate import migrate
from .progress import wait_for, wait_for_async
from .publish import Outbox, Published
from .settings import RelaySettings
from .worker import Worker

__all__ = [
    "ConfigurationError",
    "Event",
    "IdempotencyConflict",
    "InvalidEvent",
    "Outbox",
    "OutboxError",
    "Published",
    "RelaySettings",
    "SchemaError",
    "Worker",
    "migrate",
    "wait_for",
    "wait_for_async",
]
__version__ = "0.1.0"
