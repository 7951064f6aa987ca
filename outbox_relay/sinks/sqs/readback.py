"""What the SQS queues of a sink hold: (event id, partition key, queue name) per message, in each queue's
order (per message group: SQS's; across groups, as received).

SQS has no read that leaves messages in place: a received message is hidden until it is deleted or its
visibility timeout ends, and on a FIFO queue no later message of its group is handed out while it is
hidden (so a read that hides without deleting sees at most the first 10 messages of each group, and
one with ``VisibilityTimeout=0`` sees the same first ones again). ``read_back`` therefore CONSUMES:
it receives and deletes every message of the queues it reads. Point it (and ``outbox-relay verify``) at
queues nothing else reads, e.g. a copy of the stream for the check.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection
from typing import Any

from ...errors import ConfigurationError
from ...sqs_settings import SqsFields, queue_name_of
from .client import make_client

QUIET_SECONDS = 1  # a queue is read to its end once a receive waited this long (long polling) and got nothing
HIDE_SECONDS = 60  # received messages stay hidden this long; they are deleted at once


def read_back(fields: SqsFields, *, topics: Collection[str] | None = None, timeout_seconds: float = 5.0,
              quiet_seconds: int = QUIET_SECONDS) -> list[tuple[uuid.UUID, str, str]]:
    """Receive and delete every message of the sink's queues (those of ``topics``, else of
    ``--sqs-topics``, else every queue whose name starts with ``--sqs-queue-prefix`` and every queue of
    ``--sqs-queue-urls``); (event id, partition key, queue name) each, in order per queue. A queue is
    read until a receive got nothing for ``quiet_seconds`` (whole seconds of long polling; 0: short polling,
    which on SQS may answer empty while a queue holds messages), at most ``timeout_seconds`` in all.
    Messages that are not an outbox event's (no ``ce-id``) are received and deleted too, and skipped."""
    if not fields.sqs_url:
        raise ConfigurationError("no SQS endpoint: pass --sqs-url or set OUTBOX_SQS_URL")
    client = make_client(fields.sqs_url, region=fields.sqs_region, profile=fields.sqs_profile,
                         connect_timeout_seconds=fields.sqs_connect_timeout_seconds,
                         timeout_seconds=max(fields.sqs_timeout_seconds, quiet_seconds + 5.0),
                         ca_file=fields.sqs_ca_file, verify_tls=fields.sqs_tls_verify)
    try:
        deadline = time.monotonic() + timeout_seconds
        out: list[tuple[uuid.UUID, str, str]] = []
        for url in _queue_urls(client, fields, topics):
            out.extend(_drain(client, url, deadline, quiet_seconds))
        return out
    finally:
        client.close()


def _queue_urls(client: Any, fields: SqsFields, topics: Collection[str] | None) -> list[str]:
    chosen = list(topics) if topics is not None else list(fields.sqs_topics)
    given = fields.sqs_queue_urls
    if chosen:
        urls = []
        for topic in chosen:
            if topic in given:
                urls.append(given[topic])
                continue
            try:
                urls.append(str(client.get_queue_url(QueueName=f"{fields.sqs_queue_prefix}{topic}.fifo")["QueueUrl"]))
            except client.exceptions.QueueDoesNotExist:
                continue  # nothing was ever delivered there
        return urls
    if not fields.sqs_queue_prefix and not given:
        raise ConfigurationError("sqs read_back: name the topics (or set --sqs-queue-prefix or --sqs-queue-urls): "
                                 "it consumes what it reads, so it never reads every queue of the account")
    urls = list(dict.fromkeys(given.values()))
    if fields.sqs_queue_prefix:
        pages = client.get_paginator("list_queues").paginate(QueueNamePrefix=fields.sqs_queue_prefix)
        urls += sorted({u for page in pages for u in page.get("QueueUrls", ()) if u not in urls},
                       key=queue_name_of)
    return urls


def _drain(client: Any, url: str, deadline: float, quiet: int) -> list[tuple[uuid.UUID, str, str]]:
    name = queue_name_of(url)
    out: list[tuple[uuid.UUID, str, str]] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return out
        reply = client.receive_message(QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=HIDE_SECONDS,
                                       WaitTimeSeconds=max(0, min(quiet, int(left))),
                                       MessageAttributeNames=["All"], MessageSystemAttributeNames=["All"])
        messages = reply.get("Messages") or []
        if not messages:
            return out
        for m in messages:
            attributes = m.get("MessageAttributes") or {}
            event_id = attributes.get("ce-id", {}).get("StringValue")
            key = attributes.get("ce-partitionkey", {}).get("StringValue")
            if event_id is not None and key is not None:
                out.append((uuid.UUID(event_id), key, name))
        client.delete_message_batch(QueueUrl=url, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                                                           for i, m in enumerate(messages)])
