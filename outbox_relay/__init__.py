"""outbox-relay: transactional outbox on PostgreSQL, relayed to Kafka in order per key.

Producers: ``Outbox().publish(conn, ...)`` inside the business transaction.
Relays: the ``outbox-relay`` command, or ``Worker(RelaySettings(...)).run()``.
"""

from .errors import ConfigurationError, InvalidEvent, OutboxError, SchemaError
from .event import Event
from .migrate import migrate
from .publish import Outbox, Published
from .settings import RelaySettings
from .worker import Worker

__all__ = [
    "ConfigurationError",
    "Event",
    "InvalidEvent",
    "Outbox",
    "OutboxError",
    "Published",
    "RelaySettings",
    "SchemaError",
    "Worker",
    "migrate",
]
__version__ = "0.1.0"
