"""The event envelope producers publish, validated before anything is written."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import InvalidEvent

MAX_KEY_BYTES = 1024  # also a CHECK on outbox.events.partition_key
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")  # Kafka's own rule for topic names


def uuid7() -> uuid.UUID:
    """A time-ordered UUID (RFC 9562 v7); PostgreSQL 15 has no uuidv7(), so Python makes it."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & (2**48 - 1)) << 80 | 0x7 << 76 | (rand >> 64 & 0xFFF) << 64 | 0b10 << 62 | rand & (2**62 - 1)
    return uuid.UUID(int=value)


class Event(BaseModel):
    """One event. ``key`` orders it: events with one key reach every sink in publish order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: str = Field(min_length=1, max_length=255)
    key: str
    payload: Any
    topic: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=512)
    id: uuid.UUID = Field(default_factory=uuid7)
    time: datetime | None = None  # None: the database clock at insert

    @field_validator("key")
    @classmethod
    def _key(cls, key: str) -> str:
        if not key:
            raise ValueError("must not be empty")
        if len(key.encode()) > MAX_KEY_BYTES:
            raise ValueError(f"is {len(key.encode())} bytes; the limit is {MAX_KEY_BYTES}")
        return key

    @field_validator("topic")
    @classmethod
    def _topic(cls, topic: str | None) -> str | None:
        if topic is not None and not _TOPIC.match(topic):
            raise ValueError(f"{topic!r} is not a Kafka topic name (1-249 of A-Z a-z 0-9 . _ -)")
        return topic

    def payload_json(self) -> str:
        try:
            return json.dumps(self.payload, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise InvalidEvent(f"payload of {self.type!r} event (key {self.key!r}) is not JSON: {exc}") from None


def make_event(**fields: Any) -> Event:
    """Build an Event, turning pydantic's ValidationError into InvalidEvent naming the fields."""
    try:
        return Event(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'event'}: {err['msg']}" for err in exc.errors()
        )
        raise InvalidEvent(f"invalid event: {problems}") from None
