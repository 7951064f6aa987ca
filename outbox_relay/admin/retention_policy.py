"""History partitions and retention classes (docs/history.md): list, set and drop classes, map topics, roll."""

from __future__ import annotations

from dataclasses import dataclass

from .. import history
from ..errors import ConfigurationError
from .table import DEFAULT_PARTITION_SECONDS, DEFAULT_RETENTION_SECONDS, Conn, Table, fetch_history


@dataclass(frozen=True)
class Retention:
    """What ``outbox-relay retention list`` shows: the retention classes (keep, topics) and, per class,
    its partitions, size, oldest event and what holds its oldest partition back (docs/history.md)."""

    classes: Table
    history: Table


@dataclass(frozen=True)
class RetentionClassSet:
    """A retention class as ``set_retention_class`` left it: ``keep_seconds`` None keeps its events for
    good; ``follows_relays``: the default class keeps the relays' --retention-seconds again."""

    name: str
    keep_seconds: float | None
    follows_relays: bool


@dataclass(frozen=True)
class TopicRetention:
    """A topic's retention class from the next partition on (``set_topic_retention``)."""

    topic: str
    class_name: str


@dataclass(frozen=True)
class PartitionRolled:
    """``roll_history``: events now go to the range partition ``partition``."""

    partition: str


def retention(conn: Conn, retention_seconds: float = DEFAULT_RETENTION_SECONDS) -> Retention:
    """The retention classes and history per class (``retention_seconds``: the relays' setting, what the
    default class keeps unless set)."""
    return Retention(classes=fetch_history(conn, "classes", retention_seconds),
                     history=fetch_history(conn, "by_class", retention_seconds))


def history_partitions(conn: Conn, retention_seconds: float = DEFAULT_RETENTION_SECONDS) -> Table:
    """Every partition of outbox.events: xid range, class, topics, size, what holds it."""
    return fetch_history(conn, "partitions", retention_seconds)


def set_retention_class(conn: Conn, name: str, keep_seconds: float | str | None) -> RetentionClassSet:
    """Create class ``name`` or change its keep: seconds, None (for good), or "relays" (the default class
    only: back to the relays' --retention-seconds). ConfigurationError names a bad name or keep."""
    if keep_seconds == "relays":
        if name != "default":
            raise ConfigurationError("keeping what the relays' --retention-seconds says is for the default class only")
        history.reset_default(conn)
        return RetentionClassSet(name, None, True)
    if isinstance(keep_seconds, str):
        raise ConfigurationError(f"retention class {name!r}: keep must be seconds, None or 'relays', "
                                 f"not {keep_seconds[:100]!r}")
    history.set_class(conn, name, keep_seconds)
    return RetentionClassSet(name, keep_seconds, False)


def drop_retention_class(conn: Conn, name: str) -> None:
    """Remove class ``name``; refused (ConfigurationError) while topics are mapped to it or partitions hold it."""
    history.drop_class(conn, name)


def set_topic_retention(conn: Conn, topic: str, class_name: str) -> TopicRetention:
    """Put ``topic`` in ``class_name`` ('default': back to the default class), from the next partition on."""
    history.map_topic(conn, topic, class_name)
    return TopicRetention(topic, class_name)


def roll_history(conn: Conn, partition_seconds: float = DEFAULT_PARTITION_SECONDS) -> PartitionRolled:
    """End the partition being written and start the next one now (class and topic changes apply from it)."""
    return PartitionRolled(history.roll(conn, partition_seconds))
