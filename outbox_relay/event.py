"""The event envelope producers publish, validated before anything is written."""

from __future__ import annotations

import builtins
import json
import os
import re
import threading
import time
import unicodedata
import uuid
from datetime import UTC, datetime
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StrictStr, ValidationError, field_validator

from .errors import InvalidEvent

# A payload as the JSON text stored (compact, Unicode kept, no NaN); one encoder, since json.dumps
# with options builds a new one at every call.
dump_payload = json.JSONEncoder(allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode

MAX_KEY_BYTES = 1024  # also a CHECK on outbox.events.partition_key
# The largest payload publish accepts, as UTF-8 JSON text. PostgreSQL's jsonb refuses a value whose
# binary form passes 256 MB (ProgramLimitExceeded, which would abort the caller's transaction), and
# that form can be up to ~6x the text (an array of small numbers): 32 MiB of text stays below it.
MAX_PAYLOAD_BYTES = 32 * 1024 * 1024
# The most an event's headers may hold, names and values in UTF-8: they are stored as jsonb too, and
# a value PostgreSQL refuses fails the INSERT mid-statement, which aborts the caller's transaction.
MAX_HEADERS_BYTES = MAX_PAYLOAD_BYTES
MAX_SCHEMA_VERSION = 32767  # also a CHECK on outbox.events.schema_version
# How deeply a payload may nest (objects and arrays). JSON parsers recurse once per level: Python's
# json (the relay, projections) stops near 1,000 levels minus the caller's own stack, so a payload
# close to that is stored and then fails in every sink that reads it. 256 leaves room for them all.
MAX_PAYLOAD_DEPTH = 256
# The times an event may carry: those every PostgreSQL session time zone reads back as a Python datetime
# (years 1-9999; zones are less than a day from UTC). PostgreSQL stores years up to 294276 and BC too,
# and psycopg can not load those into a datetime: the relay's read of the event's bucket would fail.
EARLIEST_TIME = datetime(1, 1, 2, tzinfo=UTC)
LATEST_TIME = datetime(9999, 12, 30, 23, 59, 59, 999999, tzinfo=UTC)
# Kafka's own rule for topic names; fullmatch, since "$" would also match before a trailing newline.
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
# Headers the relay sets on every Kafka message (sinks/kafka/message.py); the trigger outbox.check_event_v4
# refuses the same names, so that consumers never see two values for one of them.
RESERVED_HEADERS = frozenset({
    "ce_specversion", "ce_id", "ce_source", "ce_type", "ce_time", "ce_sequence", "ce_partitionkey",
    "content-type",
})
RESERVED_HEADER_PREFIX = "outbox_"
RESERVED_HEADER_KEYS = frozenset(name.replace("-", "_") for name in RESERVED_HEADERS)  # as header_name_keys gives


def uuid7() -> uuid.UUID:
    """A time-ordered UUID (RFC 9562 v7); PostgreSQL 15 has no uuidv7(), so Python makes it."""
    ms = time.time_ns() // 1_000_000
    rand = _random80()
    value = (ms & (2**48 - 1)) << 80 | 0x7 << 76 | (rand >> 64 & 0xFFF) << 64 | 0b10 << 62 | rand & (2**62 - 1)
    return uuid.UUID(int=value)


# os.urandom per id was a system call per event (a fifth of publish_many's Python time): ids take
# their random bits from a per-thread buffer instead, emptied in a forked child so that parent and
# child never hand out the same bytes.
_entropy = threading.local()
os.register_at_fork(after_in_child=lambda: _entropy.__dict__.clear())


def _random80() -> int:
    # An offset into the buffer: slicing off the used bytes copied the rest at every id.
    pos: int = getattr(_entropy, "pos", 1280)
    if pos >= 1280:
        _entropy.buf, pos = os.urandom(1280), 0
    _entropy.pos = pos + 10
    return int.from_bytes(_entropy.buf[pos:pos + 10], "big")


class Event(BaseModel):
    """One event. ``key`` orders it: events with one key reach every sink in publish order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: str = Field(min_length=1, max_length=255)
    key: str
    payload: Any
    topic: str | None = None
    # Strict: bytes would otherwise be decoded silently; names and values are sent as they are.
    headers: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=512)
    id: uuid.UUID = Field(default_factory=uuid7)
    # When the event happened, in the producer's view: stored as occurred_at, sent as ce_time. It is
    # never the retention clock (created_at, set by the database). None: ce_time is when it was stored.
    # Aware only: a naive time would be read in the database session's time zone.
    time: AwareDatetime | None = None
    # The version of the payload's schema (stored as schema_version): projections, rebuilds and replays
    # turn older versions into the current shape with upcasters (upcast.py).
    version: int = Field(1, ge=1, le=MAX_SCHEMA_VERSION)

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
        if topic is not None and (not _TOPIC.fullmatch(topic) or topic in (".", "..")):
            raise ValueError(f"{topic!r} is not a Kafka topic name (1-249 of A-Z a-z 0-9 . _ -, not . or ..)")
        return topic

    @field_validator("time")
    @classmethod
    def _time(cls, time: datetime | None) -> datetime | None:
        if time is not None and not EARLIEST_TIME <= time <= LATEST_TIME:
            raise ValueError(f"{time.isoformat()} is out of range: a time must lie between "
                             f"{EARLIEST_TIME.isoformat()} and {LATEST_TIME.isoformat()} (every time zone reads it "
                             "back as a datetime); for an unknown time leave time out, not datetime.min or max")
        return time

    @field_validator("headers")
    @classmethod
    def _headers(cls, headers: dict[str, str]) -> dict[str, str]:
        for name in headers:
            if _is_reserved_header(name):
                raise ValueError(f"{name!r} is reserved for the relay (the ce_* headers it sets, content-type, "
                                 f"and every name starting with {RESERVED_HEADER_PREFIX!r}, in any case, with - "
                                 "for _ and lookalike or invisible characters folded)")
        return headers

    @field_validator("payload")
    @classmethod
    def _payload(cls, payload: Any) -> Any:
        if _nested_deeper_than(payload, MAX_PAYLOAD_DEPTH):
            raise ValueError(f"is nested more than {MAX_PAYLOAD_DEPTH} levels deep (or contains itself); "
                             f"the limit is MAX_PAYLOAD_DEPTH = {MAX_PAYLOAD_DEPTH}")
        return payload

    def payload_json(self) -> str:
        try:
            return dump_payload(self.payload)
        except (TypeError, ValueError) as exc:
            raise InvalidEvent(f"payload of {self.type!r} event (key {self.key!r}) is not JSON: {exc}") from None
        except RecursionError:  # only an Event built without validation (model_construct) gets here
            raise InvalidEvent(f"payload of {self.type!r} event (key {self.key!r}) is nested more than "
                               f"{MAX_PAYLOAD_DEPTH} levels deep") from None


def plain_fields_valid(type: Any, key: Any, payload: Any, topic: Any, idempotency_key: Any, time: Any,
                       version: Any, payload_json: str | None = None) -> bool:
    """Whether ``publish``'s arguments without headers or id certainly pass ``Event``'s rules, which then
    would keep every value as given. Checked without building the model, which was about half of
    publish's own time. Only the usual shapes are judged (exactly str and int, an aware datetime):
    False means "not sure", and the caller builds the Event, whose error names the problem.
    ``payload_json``: the payload as JSON already, so that its depth is walked only when its text opens
    more containers than the depth limit (each level opens one: fewer can not nest too deep)."""
    if not (builtins.type(type) is str and 0 < len(type) <= 255 and builtins.type(key) is str
            and builtins.type(topic) is str and builtins.type(version) is int and 1 <= version <= MAX_SCHEMA_VERSION):
        return False
    if idempotency_key is not None and not (builtins.type(idempotency_key) is str and 0 < len(idempotency_key) <= 512):
        return False
    if time is not None and not (builtins.type(time) is datetime and time.utcoffset() is not None
                                 and EARLIEST_TIME <= time <= LATEST_TIME):
        return False
    if not key or len(key) > MAX_KEY_BYTES or (not key.isascii() and _utf8_length(key) > MAX_KEY_BYTES):
        return False
    if topic in (".", "..") or not _TOPIC.fullmatch(topic):
        return False
    if not isinstance(payload, (dict, list, tuple)):
        return True
    if payload_json is not None and payload_json.count("[") + payload_json.count("{") <= MAX_PAYLOAD_DEPTH:
        return True
    return not _nested_deeper_than(payload, MAX_PAYLOAD_DEPTH)


def _utf8_length(text: str) -> int:
    try:
        return len(text.encode())
    except UnicodeEncodeError:  # a lone surrogate: let Event report it
        return MAX_KEY_BYTES + 1


# What header_name_key drops: whitespace and the invisible format characters (soft hyphen, zero-width
# and bidi marks, variation selectors, fillers); the same list as outbox.header_name_key_v1.
_INVISIBLE = re.compile("[\\s\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e"
                        "\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0]")


def header_name_keys(name: str) -> set[str]:
    """A header name as the reserved-name check compares it: NFKC (fullwidth letters become ASCII),
    whitespace and invisible characters dropped, lower case, '-' read as '_'. Two lower-case forms:
    PostgreSQL's lower() maps one character to one (U+0130 to "i"), Python's may give two; refusing
    both means nothing Python lets through is refused by the trigger mid-statement."""
    base = _INVISIBLE.sub("", unicodedata.normalize("NFKC", name))
    return {lowered.replace("-", "_") for lowered in (base.lower(), "".join(c.lower()[:1] for c in base))}


def _is_reserved_header(name: str) -> bool:
    return any(k in RESERVED_HEADER_KEYS or k.startswith(RESERVED_HEADER_PREFIX) for k in header_name_keys(name))


def _nested_deeper_than(payload: Any, limit: int) -> bool:
    """Whether ``payload`` nests more than ``limit`` containers deep. Iterative, so that no depth
    (and no payload that contains itself) can raise RecursionError here."""
    containers = (dict, list, tuple)  # what json.dumps walks into
    stack = [(payload, 1)] if isinstance(payload, containers) else []
    while stack:
        value, depth = stack.pop()
        for child in value.values() if isinstance(value, dict) else value:
            if isinstance(child, containers):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def make_event(**fields: Any) -> Event:
    """Build an Event, turning pydantic's ValidationError into InvalidEvent naming the fields."""
    try:
        return Event(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'event'}: {err['msg']}" for err in exc.errors()
        )
        raise InvalidEvent(f"invalid event: {problems}") from None
