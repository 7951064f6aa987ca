"""Operator actions on an outbox database, as a library: everything ``outbox-relay status``, ``lag``,
``dead-letters``, ``sinks``, ``keys`` and ``retention`` do, one function each, returning dataclasses.

    import psycopg
    from outbox_relay import admin

    with psycopg.connect(dsn, autocommit=True) as conn:
        page = admin.dead_letters(conn, sink="kafka", limit=20)
        for letter in page.records():
            print(letter["event_id"], letter["last_error"])
        admin.retry_key(conn, "order:42", sink="kafka")

Every function takes a connection to a migrated database (``outbox_relay.migrate.check_schema``).
One that changes something runs in one transaction of its own (a savepoint inside the caller's); a
retry, skip or resume wakes the relays holding the buckets concerned at once. Failures raise
OutboxError (or its ConfigurationError) with a message that names the problem: a sink that does not
exist or was dropped, a key with nothing parked, a sink still in use. The CLI only parses arguments,
calls these and prints what they return.

One module per concept, each with its result dataclasses: ``overview.py`` (status),
``retention_policy.py`` (history partitions, retention classes), ``dead_letter_ops.py``, ``keys.py``,
``sink_lifecycle.py`` (list, drop, recreate), ``waiting.py`` (a sink's waiting keys), ``ledger.py`` (an
event's place in every sink), ``audit.py`` and ``samples.py`` (what the console records), ``table.py``
(``Table``, running a named query, the relays' defaults). Import every name from ``outbox_relay.admin``
itself.
"""

from ..backlog import SinkBacklog, backlog
from .audit import AuditRecord, audit_log, record_action
from .dead_letter_ops import (
    DEAD_LETTERS_LIMIT,
    DeadLetterPage,
    DeadLettersChanged,
    dead_letters,
    discard_dead_letters,
    retry_dead_letters,
)
from .keys import KEY_DEAD_LETTERS_SHOWN as KEY_DEAD_LETTERS_SHOWN
from .keys import (
    SKIPPED_ERROR,
    KeyDeadLetters,
    KeyHead,
    KeyPause,
    KeyPaused,
    KeyResumed,
    KeyRetried,
    KeySinkState,
    KeySkipped,
    KeyState,
    key_state,
    pause_key,
    resume_key,
    retry_key,
    skip_key,
)
from .keys import key_command as key_command
from .keys import operator as operator
from .ledger import EventLedger, SinkEntry, event_ledger, key_ledger
from .overview import Status, projection_history, rebuilds, relays, status
from .retention_policy import (
    PartitionRolled,
    Retention,
    RetentionClassSet,
    TopicRetention,
    drop_retention_class,
    history_partitions,
    retention,
    roll_history,
    set_retention_class,
    set_topic_retention,
)
from .samples import Sample, samples_since, take_sample
from .sink_lifecycle import SinkDrop, SinkRecreated, drop_sink, recreate_sink, sinks
from .sink_lifecycle import no_such_sink as no_such_sink
from .table import DEFAULT_MAX_ATTEMPTS as DEFAULT_MAX_ATTEMPTS
from .table import DEFAULT_PARTITION_SECONDS as DEFAULT_PARTITION_SECONDS
from .table import DEFAULT_RETENTION_SECONDS as DEFAULT_RETENTION_SECONDS
from .table import DEFAULT_WORKER_TTL_SECONDS as DEFAULT_WORKER_TTL_SECONDS
from .table import Conn as Conn
from .table import Table
from .waiting import WaitingKey, WaitingPage, paused_keys, waiting_keys

__all__ = [
    "DEAD_LETTERS_LIMIT",
    "SKIPPED_ERROR",
    "AuditRecord",
    "DeadLetterPage",
    "DeadLettersChanged",
    "EventLedger",
    "KeyDeadLetters",
    "KeyHead",
    "KeyPause",
    "KeyPaused",
    "KeyResumed",
    "KeyRetried",
    "KeySinkState",
    "KeySkipped",
    "KeyState",
    "PartitionRolled",
    "Retention",
    "RetentionClassSet",
    "Sample",
    "SinkBacklog",
    "SinkDrop",
    "SinkEntry",
    "SinkRecreated",
    "Status",
    "Table",
    "TopicRetention",
    "WaitingKey",
    "WaitingPage",
    "audit_log",
    "backlog",
    "dead_letters",
    "discard_dead_letters",
    "drop_retention_class",
    "drop_sink",
    "event_ledger",
    "history_partitions",
    "key_ledger",
    "key_state",
    "pause_key",
    "paused_keys",
    "projection_history",
    "rebuilds",
    "record_action",
    "recreate_sink",
    "relays",
    "resume_key",
    "retention",
    "retry_dead_letters",
    "retry_key",
    "roll_history",
    "samples_since",
    "set_retention_class",
    "set_topic_retention",
    "sinks",
    "skip_key",
    "status",
    "take_sample",
    "waiting_keys",
]
