"""A testing aid: apply a message to a handler through the real inbox transaction, without a broker.

``apply_test_message(conn, handler, value=..., ce_id=...)`` leases the partition for a ``testing``
member (as a consumer process would), then applies the message with the same code the consumer
runs: dedupe record, handler, position, one transaction. Apply the same ``ce_id`` twice to see the
duplicate skipped. The database needs the inbox tables (``migrate_inbox``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg

from ..sqlfiles import query
from .message import InboxMessage
from .store import Handler, Lease, Outcome, apply_message

TESTING_MEMBER = "testing"


def make_message(value: Any = None, *, ce_id: str | None = None, ce_type: str = "test.event", key: str | None = "k",
                 topic: str = "test-topic", partition: int = 0, offset: int = 0,
                 headers: dict[str, str] | None = None) -> InboxMessage:
    """A message as the relay writes it (CloudEvents binary mode headers); ``value`` is sent as JSON
    unless it is bytes."""
    hs: list[tuple[str, bytes | None]] = [
        ("ce_specversion", b"1.0"), ("ce_id", (ce_id or str(uuid.uuid4())).encode()), ("ce_type", ce_type.encode()),
        ("content-type", b"application/json"),
    ]
    if key is not None:
        hs.append(("ce_partitionkey", key.encode()))
    hs.extend((k, v.encode()) for k, v in (headers or {}).items())
    body = value if isinstance(value, bytes) or value is None else json.dumps(value).encode()
    return InboxMessage(topic=topic, partition=partition, offset=offset, key=key.encode() if key else None,
                        value=body, headers=tuple(hs))


def apply_test_message(conn: psycopg.Connection[Any], handler: Handler, message: InboxMessage | None = None, *,
                       consumer: str = "inbox", **fields: Any) -> Outcome:
    """Apply ``message`` (or ``make_message(**fields)``) as consumer ``consumer`` would: "applied" or
    "duplicate"; what the handler raises propagates, everything rolled back. ``conn`` must not be in
    autocommit mode; the transaction is committed."""
    message = message or make_message(**fields)
    with conn.transaction():  # lease the partition for the testing member, like a consumer's claim
        conn.execute(query("inbox", "add_partitions"), {"consumer": consumer, "topics": [message.topic],
                                                        "partitions": [message.partition]})
        row = conn.execute("UPDATE outbox_inbox.positions SET owner = %s, fence = fence + 1, "
                           "lease_until = clock_timestamp() + interval '1 hour' "
                           "WHERE consumer = %s AND topic = %s AND partition = %s RETURNING fence",
                           (TESTING_MEMBER, consumer, message.topic, message.partition)).fetchone()
    assert row is not None
    return apply_message(conn, Lease(consumer, TESTING_MEMBER, int(row[0])), message, handler)
