"""What a handler is given: one consumed message, decoded from the relay's CloudEvents binary mode."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

# A dedupe key is a btree entry (at most about 2.7 kB) in a text column (no NUL): a ce_id that can not
# be one is the message's fault, not the database's (the relay's ids are 36 characters).
MAX_ID_BYTES = 1024


@dataclass(frozen=True)
class InboxMessage:
    """One Kafka message. ``id`` is its ``ce_id`` header (the relay's event id), the inbox's dedupe key.

    A message without ``ce_id`` (not written by the relay) gets ``kafka:TOPIC:PARTITION:OFFSET``:
    it is then deduplicated by its position only, which a broker that lost its log hands out again.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...] = field(default=())
    timestamp: datetime | None = None
    # Applied by `inbox dead-letters retry`: later messages of its partition were applied before it (they
    # went on when it was dead-lettered), so a handler that keeps "the latest state" should compare versions.
    late: bool = False

    def header(self, name: str) -> str | None:
        """The last header of this name, decoded as UTF-8 (None if absent)."""
        for k, v in reversed(self.headers):
            if k == name:
                return None if v is None else v.decode("utf-8", errors="replace")
        return None

    @property
    def id(self) -> str:
        ce_id = self.header("ce_id")
        if ce_id and self.id_problem is None:
            return ce_id
        return f"kafka:{self.topic}:{self.partition}:{self.offset}"

    @property
    def id_problem(self) -> str | None:
        """Why the ``ce_id`` header can not be a dedupe key (such a message is dead-lettered uncalled), or None."""
        ce_id = self.header("ce_id")
        if ce_id is None:
            return None
        if "\x00" in ce_id:
            return "its ce_id header holds a NUL character"
        size = len(ce_id.encode())
        if size > MAX_ID_BYTES:
            return f"its ce_id header is {size} bytes long (at most {MAX_ID_BYTES})"
        return None

    @property
    def type(self) -> str | None:
        """The event type (``ce_type``)."""
        return self.header("ce_type")

    @property
    def partition_key(self) -> str | None:
        """The relay's partition key (``ce_partitionkey``, also the message key)."""
        return self.header("ce_partitionkey") or (self.key.decode("utf-8", errors="replace") if self.key else None)

    def json(self) -> Any:
        """The value as JSON (the relay's payloads are JSON); None for an empty value."""
        return None if self.value is None else json.loads(self.value)


def header_lists(headers: Sequence[tuple[str, bytes | None]]) -> tuple[list[str], list[bytes | None]]:
    # A header name is stored as text, which can not hold NUL (a producer's bytes, kept as readable as may be).
    return [k.replace("\x00", "\\x00") for k, _ in headers], [v for _, v in headers]
