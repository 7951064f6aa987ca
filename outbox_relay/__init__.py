"""outbox-relay: transactional outbox on PostgreSQL, relayed to Kafka in order per key.

Producers: ``Outbox().publish(conn, ...)`` inside the business transaction. Importing this package
loads neither the relay engine nor confluent-kafka.
Relays: the ``outbox-relay`` command, or ``Relay(RelaySettings(...), sinks=[...]).start()`` in your process.
"""

from typing import TYPE_CHECKING, Any

from .errors import ConfigurationError, IdempotencyConflict, InvalidEvent, OutboxError, SchemaError
from .event import Event
from .migrate import migrate
from .progress import wait_for
from .progress_async import wait_for_async
from .publish import Outbox, Published
from .settings import RelaySettings

if TYPE_CHECKING:
    from .in_process import Relay
    from .worker import Worker


def __getattr__(name: str) -> Any:
    # The engine only when asked for: a producer's import stays light.
    if name == "Worker":
        from .worker import Worker

        return Worker
    if name == "__version__":
        return _version()
    if name == "Relay":
        from .in_process import Relay

        return Relay
    raise AttributeError(f"module 'outbox_relay' has no attribute {name!r}")


__all__ = [
    "ConfigurationError",
    "Event",
    "IdempotencyConflict",
    "InvalidEvent",
    "Outbox",
    "OutboxError",
    "Published",
    "Relay",
    "RelaySettings",
    "SchemaError",
    "Worker",
    "migrate",
    "wait_for",
    "wait_for_async",
]


def _version() -> str:
    """The installed distribution's version: pyproject.toml is its one source."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("outbox-relay")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"
