"""The public sink contract: what a sink you write is given and what it answers, per event.

A sink is any object with a ``name``, a ``kind`` and ``deliver(event)``::

    class Audit:
        name = "audit"
        kind = "audit"

        def deliver(self, event: SinkEvent) -> Delivered | Retry | GiveUp | None:
            ...  # send event.payload_json somewhere; return None when it is there

``deliver`` is called with one event at a time; events of one key arrive in publish order, and a
key's next event only once the previous one was delivered or given up. Answers:

- ``None`` or ``Delivered()``: done.
- ``Retry(reason, after_seconds=None)``: try again later (counts an attempt; the relay's backoff, or at
  least ``after_seconds``); past ``--max-attempts`` the event is dead-lettered with ``reason``. The
  key waits meanwhile; other keys go on.
- ``GiveUp(reason)``: never retried: dead-lettered at once; the key goes on.
- raise ``SinkUnavailable(reason, retry_after_seconds)``: the sink as a whole is down, not this event's
  fault: the event and the rest of the batch wait, no attempt counted.
- raise anything else: ``Retry`` with the exception as the reason.

Everything else (order, parking and backoff, dead letters, fencing, crash isolation, metrics,
tracing, the time limit ``--handler-timeout-seconds``) is the relay's job (``adapter.py``).
Optional attributes, read with ``getattr``: ``topics`` and ``types`` (only these events; None: all),
``concurrency`` (keys delivered at once, default 1), ``close()`` and ``idle()``.

A sink that can send several events in one round trip (a pipelining broker) may also define
``deliver_many(events) -> list`` (plain, not async): it is then called instead of ``deliver``, from one
thread, with the next event of each of up to ``concurrency`` keys (never two of one key), and returns one
answer per event, in order: those above, or a ``SinkUnavailable`` instance for an event the sink could not
take now. An exception answers for every event of the call (sinks/waves.py).
"""

from __future__ import annotations

import inspect
import json
import math
import re
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigurationError

# outbox.sinks.kind's CHECK constraint (migration 0013).
SINK_KIND = re.compile(r"^[a-z][a-z0-9_]{0,31}\Z")
# outbox.sinks.name's CHECK constraint.
SINK_NAME = re.compile(r"^[a-z0-9][a-z0-9_.:-]{0,62}\Z")
# Kinds of the product's own sinks: status, rebuild and replay treat a sink by its kind (a "projection"
# is rebuilt, a "kafka" sink replayed), so a user's sink may not take one.
RESERVED_KINDS = {"kafka": "the Kafka sink", "projection": "projections", "webhook": "outbox_relay.webhook",
                  "rabbitmq": "the RabbitMQ sink", "nats": "the NATS JetStream sink",
                  "redis": "the Redis Streams sink", "sqs": "the SQS sink"}
_PRODUCT_PACKAGES = ("outbox_relay.", "projections.")
MAX_CONCURRENCY = 256  # threads per sink: more is a configuration mistake, not a plan
MAX_WAIT_SECONDS = 86400.0  # longest Retry.after_seconds / SinkUnavailable wait honoured


@dataclass(frozen=True)
class SinkEvent:
    """One event as a sink is given it (read-only)."""

    id: uuid.UUID
    topic: str | None
    key: str  # partition key: events of one key arrive in publish order
    type: str
    payload_json: str  # the stored JSON text, as stored: send it as is
    headers: Mapping[str, str]
    time: datetime  # occurred_at, else when it was stored
    version: int  # schema_version of the payload
    attempt: int  # 1 on the first try, 2 on the first retry, ...

    @property
    def payload(self) -> Any:
        """The payload parsed (``json.loads(payload_json)``)."""
        return json.loads(self.payload_json)


@dataclass(frozen=True)
class Delivered:
    """The event is delivered (returning None means the same)."""


@dataclass(frozen=True)
class Retry:
    """Try again later: counts an attempt; dead-lettered with ``reason`` past max attempts.
    ``after_seconds``: wait at least this long (e.g. a Retry-After); None: the relay's backoff."""

    reason: str
    after_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.after_seconds is not None and not (
                isinstance(self.after_seconds, int | float) and math.isfinite(self.after_seconds)
                and self.after_seconds >= 0):
            raise ValueError(f"Retry.after_seconds must be a finite number >= 0 or None, not {self.after_seconds!r}")


@dataclass(frozen=True)
class GiveUp:
    """Never retried: dead-lettered at once with ``reason``."""

    reason: str


class SinkUnavailable(Exception):
    """The sink as a whole is down (not this event's fault): the event and the rest of the batch wait
    ``retry_after_seconds``, no attempt counted, nothing dead-lettered."""

    def __init__(self, reason: str, retry_after_seconds: float = 5.0) -> None:
        if not (isinstance(retry_after_seconds, int | float) and math.isfinite(retry_after_seconds)
                and retry_after_seconds >= 0):
            raise ValueError("SinkUnavailable.retry_after_seconds must be a finite number >= 0, "
                             f"not {retry_after_seconds!r}")
        super().__init__(reason)
        self.reason = reason
        self.retry_after_seconds = float(retry_after_seconds)


Outcome = Delivered | Retry | GiveUp | None


@runtime_checkable
class EventSink(Protocol):
    """What a user writes. Optional: ``topics``, ``types``, ``concurrency``, ``close()``, ``idle()``."""

    name: str  # unique per deployment: its row in outbox.sinks, its metrics label
    kind: str  # short identifier, e.g. "webhook" (^[a-z][a-z0-9_]{0,31}$)

    def deliver(self, event: SinkEvent) -> Outcome: ...


def check_sink(sink: object, where: str = "") -> EventSink:
    """``sink`` if it keeps the contract, else ConfigurationError naming what is missing or wrong.
    ``where`` says where it came from (e.g. ``--sink app.sinks:audit``) for the message."""
    origin = f" ({where})" if where else ""
    if isinstance(sink, type):  # its deliver would be called unbound, failing for every event
        raise ConfigurationError(f"{sink.__name__}{origin} is a class, not a sink: pass an instance "
                                 f"({sink.__name__}())")
    what = f"{type(sink).__name__} object{origin}"
    problems: list[str] = []
    name = getattr(sink, "name", None)
    if not isinstance(name, str):
        problems.append("no `name` attribute (a str, unique per deployment)" if name is None
                        else f"`name` must be a str, not {type(name).__name__}")
    elif not SINK_NAME.match(name):
        problems.append(f"name {name[:64]!r} is not a sink name (1-63 characters of a-z 0-9 _ . : -, starting with "
                        "a letter or digit)")
    kind = getattr(sink, "kind", None)
    if not isinstance(kind, str):
        problems.append("no `kind` attribute (a str, e.g. 'webhook')" if kind is None
                        else f"`kind` must be a str, not {type(kind).__name__}")
    elif not SINK_KIND.match(kind):
        problems.append(f"kind {kind[:40]!r} is not a sink kind (1-32 characters of a-z 0-9 _, starting with a letter)")
    elif kind in RESERVED_KINDS and not _product_kind(sink):
        problems.append(f"kind {kind!r} is reserved for {RESERVED_KINDS[kind]} (name your sink's own kind, e.g. "
                        "'audit')")
    if not callable(getattr(sink, "deliver", None)):
        problems.append("no `deliver(event)` method")
    for attr in ("topics", "types"):
        value = getattr(sink, attr, None)
        if value is not None and (isinstance(value, str) or not isinstance(value, Collection)
                                  or not all(isinstance(v, str) for v in value)):
            problems.append(f"`{attr}` must be None or a collection of str (e.g. a set), not {type(value).__name__}")
        elif value is not None and not any(value):  # e.g. "".split(",") from an unset variable
            problems.append(f"`{attr}` is empty: the sink would never get an event (None: all of them)")
    concurrency = getattr(sink, "concurrency", 1)
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY:
        problems.append(f"`concurrency` must be an int from 1 to {MAX_CONCURRENCY}, not {concurrency!r}")
    many = getattr(sink, "deliver_many", None)
    if many is not None and (not callable(many) or inspect.iscoroutinefunction(many)
                             or inspect.iscoroutinefunction(getattr(sink, "deliver", None))):
        problems.append("`deliver_many` must be a plain method taking a list of events (not async, and beside a "
                        "plain `deliver`)")
    for method in ("close", "idle"):
        value = getattr(sink, method, None)
        if value is not None and not callable(value):
            problems.append(f"`{method}` must be a method taking no arguments")
    if problems:
        raise ConfigurationError(f"{what} is not a sink: " + "; ".join(problems))
    return sink  # type: ignore[return-value]  # checked attribute by attribute above


def _product_kind(sink: object) -> bool:
    """Whether ``kind`` comes from the product: its own sink or wrapper (the testing kit's), or a class of it
    (a subclass of WebhookSink keeps "webhook")."""
    if type(sink).__module__.startswith(_PRODUCT_PACKAGES):
        return True
    if "kind" in getattr(sink, "__dict__", {}):
        return False
    owner = next((c for c in type(sink).__mro__ if "kind" in vars(c)), None)
    return owner is not None and owner.__module__.startswith(_PRODUCT_PACKAGES)


__all__ = ["Delivered", "EventSink", "GiveUp", "Outcome", "Retry", "SinkEvent", "SinkUnavailable", "check_sink"]
