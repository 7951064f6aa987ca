"""Declaring projections: ``@projection(...)`` makes a ``Projection``; a ``Registry`` holds them.

No global registry: ``@projection`` only builds the declaration, so two services or two tests
in one process never collide. A ``Registry`` (explicit, or gathered from a module by
``load_registry``) refuses two projections with one name.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from outbox_relay.dsn import describe_error
from outbox_relay.errors import ConfigurationError
from outbox_relay.loader import import_module
from outbox_relay.sinks.engine import Failure
from outbox_relay.store import EventFilter, StoredEvent
from outbox_relay.upcast import UpcastError, Upcasters

from .decoding import decode_headers, decode_json
from .event import FenceToken, ProjectionEvent

# A projection's name becomes its sink name and part of its rebuild schema's name, so it is
# kept to a safe identifier (63 bytes is PostgreSQL's limit; "outbox_rebuild_" takes 15).
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,47}\Z")

# Where a rebuild builds its copies and keeps replaced tables (``--keep-old``).
SHADOW_PREFIX = "outbox_rebuild_"
RETIRED_PREFIX = "outbox_retired_"
# Schemas a projection's tables may never be in, since a rebuild swaps its tables out: the relay's
# own state (a rebuild of outbox.cursors would wipe every cursor), the system catalogs, and
# rebuilds' schemas.
RESERVED_SCHEMAS = ("outbox", "pg_catalog", "information_schema")
RESERVED_PREFIXES = ("pg_", SHADOW_PREFIX, RETIRED_PREFIX)


def reserved_schema(schema: str) -> bool:
    return schema in RESERVED_SCHEMAS or schema.startswith(RESERVED_PREFIXES)

Handler = Callable[[Any, Any], Any]  # (event, tx), or (events, tx) for batch=True
KeyReset = Callable[[str, Any], Any]
OnUnknown = Literal["ignore", "reject"]


@dataclass
class Projection:
    """One read model: which events it applies, how, and which tables it owns.

    ``tables`` are the tables the handler writes (unqualified names resolve on the
    connection's search_path); a rebuild builds fresh copies of them and swaps them in.
    ``clear_key`` (set with the ``@p.key_reset`` decorator) deletes one partition key's
    state, for ``rebuild --key``.
    """

    name: str
    handler: Handler
    events: tuple[str, ...] | None  # None: every event type
    models: Mapping[str, type[BaseModel]] = field(default_factory=dict)
    topics: tuple[str, ...] | None = None  # None: every topic
    tables: tuple[str, ...] = ()
    on_unknown: OnUnknown = "ignore"
    clear_key: KeyReset | None = None
    upcasters: Upcasters | None = None  # older payload shapes turned into the current one (upcast.py)
    batch: bool = False  # the handler takes a list of events (walk.py: how a failing batch is charged)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.handler)

    @property
    def event_filter(self) -> EventFilter:
        """What the relay reads for it: the declared types (unless others are to be rejected, which
        needs seeing them) and topics."""
        return EventFilter(types=self.events if self.on_unknown == "ignore" else None, topics=self.topics)

    def prepare(self, e: StoredEvent, fence: int, replay: bool) -> ProjectionEvent[Any] | Failure | None:
        """The event as its handler sees it, a failure decided without the handler, or None (an
        event type this projection ignores)."""
        if self.events is not None and e.type not in self.events:
            if self.on_unknown == "ignore":
                return None
            return Failure(f"projection {self.name!r} does not handle event type {e.type!r}", retriable=False)
        # Stored rows can be what the relay can not hand over: written before migration 0005's
        # checks, or by a superuser. Such an event fails alone (for good: no retry changes it).
        try:
            payload: Any = decode_json(e.payload_text)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep for this stack
            return Failure(f"the event's payload can not be decoded for the handler: {describe(exc)}",
                           retriable=False)
        headers = {} if e.headers_text == "{}" else decode_headers(e.headers_text)  # most events have none
        if isinstance(headers, Failure):
            return headers
        version = e.version
        if self.upcasters is not None:
            try:
                payload, version = self.upcasters.upcast(e.type, e.version, payload)
            except UpcastError as exc:
                return Failure(str(exc), retriable=exc.retriable)
        if self.models:
            model = self.models.get(e.type)
            if model is not None:
                try:
                    payload = model.model_validate(payload)
                except ValidationError as exc:
                    return Failure(describe(exc), retriable=False)
        # make_event(..., make_token(...)) written out: a relay prepares every event it hands over, and
        # the two calls cost a fifth of it (test_event_decoding: the same object as the constructors').
        xid = e.xid
        seq = e.seq
        token = _new(FenceToken)
        _set(token, "__dict__", {"fence": fence, "read": e.read, "xid": xid, "seq": seq})
        event: ProjectionEvent[Any] = _new(ProjectionEvent)
        _set(event, "__dict__", {"id": e.id, "type": e.type, "key": e.key, "topic": e.topic, "payload": payload,
                                 "headers": headers, "time": e.time, "position": (xid, seq), "token": token,
                                 "attempt": e.attempts + 1, "replay": replay, "version": version})
        return event

    def __call__(self, event: Any, tx: Any) -> Any:
        """Call the handler directly (in tests of the handler itself; a list of events if ``batch``)."""
        return self.handler(event, tx)

    def key_reset(self, fn: KeyReset) -> KeyReset:
        """Decorator: ``fn(key, tx)`` deletes the read-model state of one partition key."""
        self.clear_key = fn
        return fn


def projection(
    name: str,
    events: Iterable[str] | Mapping[str, type[BaseModel]] | None = None,
    *,
    topics: Iterable[str] | None = None,
    tables: Iterable[str] = (),
    on_unknown: OnUnknown = "ignore",
    upcasters: Upcasters | None = None,
    batch: bool = False,
) -> Callable[[Handler], Projection]:
    """Declare a projection. The decorated function becomes a ``Projection``.

    ``events``: the event types it applies; a mapping of type to pydantic model also
    validates each payload into that model (a payload that does not validate is
    dead-lettered at once). None: every type. ``on_unknown``: what to do with an event of
    another type: "ignore" (skipped, never read) or "reject" (dead-lettered with the
    reason, for models that must know every event on their topics). ``topics`` narrows
    which events are this projection's business at all. ``upcasters``: payloads of older schema
    versions are turned into the current shape first (``outbox_relay.upcast.Upcasters``), live and in
    rebuilds. ``batch``: the handler is called as ``handler(events, tx)`` with a list of events in
    delivery order (per key order kept), for set-based writes; exactly-once is unchanged, and a
    failing batch is walked again one event at a time so that only the failing event is charged.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigurationError(
            f"projection name {name!r} must be 1-48 characters of a-z, 0-9 and _, starting with a letter")
    if on_unknown not in ("ignore", "reject"):
        raise ConfigurationError(f"projection {name!r}: on_unknown must be 'ignore' or 'reject', not {on_unknown!r}")
    models: dict[str, type[BaseModel]] = {}
    types: tuple[str, ...] | None = None
    if isinstance(events, Mapping):
        for t, model in events.items():
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise ConfigurationError(f"projection {name!r}: the model for {t!r} is not a pydantic model")
        models = dict(events)
        types = tuple(events)
    elif events is not None:
        if isinstance(events, str):
            raise ConfigurationError(f"projection {name!r}: events must be a list of types, not the string {events!r}")
        types = tuple(events)
    if types is not None and (not types or not all(isinstance(t, str) and t for t in types)):
        raise ConfigurationError(f"projection {name!r}: events must be non-empty type names")
    if upcasters is not None and not isinstance(upcasters, Upcasters):
        raise ConfigurationError(f"projection {name!r}: upcasters must be an outbox_relay.upcast.Upcasters, "
                                 f"not {type(upcasters).__name__}")
    if on_unknown == "reject" and types is None:
        raise ConfigurationError(f"projection {name!r}: on_unknown='reject' needs the list of events it handles")
    if not isinstance(batch, bool):
        raise ConfigurationError(f"projection {name!r}: batch must be True or False, not {batch!r}")
    table_names = _table_names(name, tables)

    def decorate(handler: Handler) -> Projection:
        if not callable(handler):
            raise ConfigurationError(f"projection {name!r}: the handler is not callable")
        return Projection(name=name, handler=handler, events=types, models=models,
                          topics=tuple(topics) if topics is not None else None, tables=table_names,
                          on_unknown=on_unknown, upcasters=upcasters, batch=batch)

    return decorate


def _table_names(name: str, tables: Iterable[str]) -> tuple[str, ...]:
    """``tables=`` checked: names, each once, none in a schema a rebuild must never swap tables of
    (names without a schema are checked again where they resolve, when a rebuild starts)."""
    if isinstance(tables, str):
        raise ConfigurationError(f"projection {name!r}: tables must be a list of table names, not the string "
                                 f"{tables!r}")
    names = tuple(tables)
    for t in names:
        if not isinstance(t, str) or not t.strip():
            raise ConfigurationError(f"projection {name!r}: tables must be non-empty table names, not {t!r}")
        if "." in t:
            schema = t.rsplit(".", 1)[0].rsplit(".", 1)[-1]
            schema = schema[1:-1] if schema.startswith('"') and schema.endswith('"') else schema.lower()
            if reserved_schema(schema):
                raise ConfigurationError(
                    f"projection {name!r}: table {t!r} is in schema {schema!r}, which holds the relay's own state, "
                    "the system catalogs or a rebuild's tables; a rebuild swaps a projection's tables out, so "
                    "a projection keeps its read model in tables of its own")
    if len(set(names)) != len(names):
        raise ConfigurationError(f"projection {name!r}: tables= names a table more than once: {list(names)}")
    return names


class Registry:
    """Projections by name. Add with ``add`` or declare straight into it with ``registry.projection``."""

    def __init__(self, projections: Iterable[Projection] = ()) -> None:
        self._by_name: dict[str, Projection] = {}
        for p in projections:
            self.add(p)

    def add(self, p: Projection) -> Projection:
        if not isinstance(p, Projection):
            raise ConfigurationError(f"not a projection: {p!r} (decorate the handler with @projection)")
        known = self._by_name.get(p.name)
        if known is not None and known is not p:
            raise ConfigurationError(f"two projections are named {p.name!r}")
        self._by_name[p.name] = p
        return p

    def projection(self, name: str, events: Iterable[str] | Mapping[str, type[BaseModel]] | None = None,
                   **options: Any) -> Callable[[Handler], Projection]:
        """``@registry.projection(...)``: declare and add in one step."""
        declare = projection(name, events, **options)
        return lambda handler: self.add(declare(handler))

    def get(self, name: str) -> Projection:
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(sorted(self._by_name)) or "none"
            raise ConfigurationError(f"unknown projection {name!r} (known: {known})") from None

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __iter__(self) -> Iterator[Projection]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)


def load_registry(spec: str) -> Registry:
    """The projections of ``module`` or ``module:attribute`` (a Registry, or a Projection).

    A bare module contributes every Registry and every Projection at its top level.
    """
    module_name, _, attribute = spec.partition(":")
    module = import_module(module_name, f"--projections {spec}")
    if attribute:
        try:
            target = getattr(module, attribute)
        except AttributeError:
            raise ConfigurationError(f"module {module_name!r} has no attribute {attribute!r}") from None
        if isinstance(target, Registry):
            return target
        if isinstance(target, Projection):
            return Registry([target])
        raise ConfigurationError(f"{spec!r} is neither a Registry nor a Projection")
    registry = Registry()
    for value in vars(module).values():
        if isinstance(value, Registry):
            for p in value:
                registry.add(p)
        elif isinstance(value, Projection):
            registry.add(value)
    if not len(registry):
        raise ConfigurationError(f"module {module_name!r} declares no projections")
    return registry


_new = object.__new__
_set = object.__setattr__

def describe(exc: BaseException) -> str:
    """An exception as a dead letter's or parked event's last error (no secrets, bounded)."""
    return describe_error(exc)
