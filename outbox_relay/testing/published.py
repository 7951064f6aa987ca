"""Published-event assertions: what a test's connection (or a ``FakeOutbox``) shows was published.

- ``published(conn, key=..., type=..., topic=...)``: the events the test's connection can see (its
  own open transaction's included), in the relay's order; ``apublished`` for async connections.
- ``assert_published(conn, [("OrderPlaced", {...}), "OrderPaid"], key="order:1")``: exactly these
  events, in this order, with a readable report when not; ``assert_not_published``.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from outbox_relay.publish import Published

from .published_event import PublishedEvent as PublishedEvent
from .published_event import Source
from .reading import published as published
from .reading_async import apublished as apublished

FIELDS = ("type", "key", "topic", "payload", "headers", "idempotency_key", "id", "time")
SHOWN = 20  # events listed in a failure message before "... and N more"
_PAYLOAD_CHARS = 300


# -- assertions ------------------------------------------------------------------------------------


def assert_published(source: Source, expected: Iterable[Any], *, key: str | None = None,
                     type: str | None = None, topic: str | None = None) -> list[PublishedEvent]:
    """Assert that the events of ``key``/``type``/``topic`` (all events if none is given) are exactly
    ``expected``, in this order, and return them.

    Order is ``(xid, seq)``, per key the relay's (but for overlapping transactions of one key, see
    ``PublishedEvent``). Without ``key`` the list is all matching events in ``(xid, seq)`` order,
    which in a test that publishes from one thread is the order of its publish calls; across keys
    that is more than the relay promises, so prefer ``key=``.

    Each expected event is a type name (``"OrderPaid"``), a ``(type, payload)`` pair, or a dict of
    the fields to compare (``type``, ``key``, ``topic``, ``payload``, ``headers``,
    ``idempotency_key``, ``id``, ``time``); fields left out are not compared, and
    ``unittest.mock.ANY`` matches anything, also inside a payload. Payloads compare as decoded JSON
    (a tuple was stored as a list). On a mismatch the AssertionError lists, event by event, what
    was expected and what was published.

    ``source``: a connection (sync; with an async one pass ``await apublished(conn)``), a
    ``FakeOutbox`` or a list of ``PublishedEvent``.
    """
    wanted = _expectations(expected)
    events = published(source, key=key, type=type, topic=topic)
    if len(events) == len(wanted) and all(_matches(e, w) for e, w in zip(events, wanted, strict=True)):
        return events
    raise AssertionError(_difference(source, events, wanted, _scope(key, type, topic)))


def assert_not_published(source: Source, *, key: str | None = None, type: str | None = None,
                         topic: str | None = None) -> None:
    """Assert that no event of ``key``/``type``/``topic`` is visible (with no filter: no event at all)."""
    events = published(source, key=key, type=type, topic=topic)
    if events:
        lines = [f"assert_not_published: {len(events)} event(s) {_scope(key, type, topic)} were published:"]
        lines += [f"  {_show_event(e, identify=True)}" for e in events[:SHOWN]]
        lines += _more(events)
        raise AssertionError("\n".join(lines))


def _expectations(expected: Iterable[Any]) -> list[dict[str, Any]]:
    """Each expected event as the fields to compare; a malformed one is named (TypeError)."""
    if isinstance(expected, str | bytes | Mapping) or not isinstance(expected, Iterable):
        raise TypeError(f"expected must be a list of events, not a {type(expected).__name__} (write [{expected!r}])")
    out = []
    for n, item in enumerate(expected, 1):
        if isinstance(item, str):
            fields: dict[str, Any] = {"type": item}
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            fields = {"type": item[0], "payload": item[1]}
        elif isinstance(item, Mapping):
            unknown = sorted(str(f) for f in item if f not in FIELDS)
            if unknown or not item:
                raise TypeError(f"expected event #{n} {dict(item)!r}: "
                                + (f"unknown field(s) {', '.join(unknown)}; " if unknown else "no fields; ")
                                + f"an expected event compares some of {', '.join(FIELDS)}")
            fields = dict(item)
            if isinstance(fields.get("id"), Published):
                fields["id"] = fields["id"].id
        else:
            raise TypeError(f"expected event #{n} is {item!r}: give a type name, a (type, payload) pair or a dict "
                            f"of fields ({', '.join(FIELDS)})")
        out.append(fields)
    return out


def _matches(event: PublishedEvent, wanted: Mapping[str, Any]) -> bool:
    # The expected value on the left: unittest.mock.ANY (there, or nested in it) then decides.
    return all(bool(value == getattr(event, name)) for name, value in wanted.items())


def _scope(key: str | None, type: str | None, topic: str | None) -> str:
    parts = [f"{name}={value!r}" for name, value in (("key", key), ("type", type), ("topic", topic))
             if value is not None]
    return f"with {', '.join(parts)}" if parts else "in the outbox"


def _json(value: Any) -> str:
    try:
        # Sorted keys: an expected payload and a stored one (jsonb orders keys its own way) line up.
        text = json.dumps(value, ensure_ascii=False, default=repr, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _PAYLOAD_CHARS else text[:_PAYLOAD_CHARS] + "..."


def _show_expected(wanted: Mapping[str, Any]) -> str:
    parts = [str(wanted["type"])] if "type" in wanted else []
    if "payload" in wanted:
        parts.append(_json(wanted["payload"]))
    parts += [f"{name}={_json(value)}" for name, value in wanted.items() if name not in ("type", "payload")]
    return " ".join(parts)


def _show_event(event: PublishedEvent, fields: Iterable[str] = (), identify: bool = False) -> str:
    parts = [event.type, _json(event.payload)]
    extra = [f for f in FIELDS if f in fields and f not in ("type", "payload")]
    if identify:
        extra = ["key", "topic", *extra, "id"]
    parts += [f"{name}={_json(str(v) if isinstance(v, uuid.UUID | datetime) else v)}"
              for name in dict.fromkeys(extra) for v in [getattr(event, name)]]
    return " ".join(parts)


def _more(events: Sequence[Any]) -> list[str]:
    return [f"  ... and {len(events) - SHOWN} more"] if len(events) > SHOWN else []


def _difference(source: Source, events: list[PublishedEvent], wanted: list[dict[str, Any]], scope: str) -> str:
    """The failure message of assert_published: expected and published side by side, by position."""
    lines = [f"assert_published: the events {scope} are not the expected ones "
             f"({len(wanted)} expected, {len(events)} published), in position order:"]
    for i in range(max(len(events), len(wanted))):
        if i == SHOWN:
            lines.append(f"  ... and {max(len(events), len(wanted)) - SHOWN} more")
            break
        e = events[i] if i < len(events) else None
        w = wanted[i] if i < len(wanted) else None
        n = f"{i + 1:>3}"
        if e is not None and w is not None and _matches(e, w):
            lines.append(f"{n} ok         {_show_event(e, w)}")
        elif e is not None and w is not None:
            differ = [name for name, value in w.items() if not bool(value == getattr(e, name))]
            lines.append(f"{n} DIFFERS    expected:  {_show_expected(w)}")
            lines.append(f"               published: {_show_event(e, w)}   ({', '.join(differ)} "
                         f"differ{'s' if len(differ) == 1 else ''})")
        elif w is not None:
            lines.append(f"{n} MISSING    expected:  {_show_expected(w)}")
        elif e is not None:
            lines.append(f"{n} UNEXPECTED published: {_show_event(e, identify=True)}")
    if events and len(events) == len(wanted) and _same_events(events, wanted):
        lines.append("The same events were published, in another order.")
    if not events and scope != "in the outbox":
        everything = published(source)
        if everything:
            found = Counter(f"key={e.key!r} type={e.type!r} topic={e.topic!r}" for e in everything)
            lines.append(f"Nothing was published {scope}; the {len(everything)} event(s) visible are:")
            lines += [f"  {count} x {what}" for what, count in found.most_common(SHOWN)]
    return "\n".join(lines)


def _same_events(events: list[PublishedEvent], wanted: list[dict[str, Any]]) -> bool:
    left = list(events)
    for w in wanted:
        hit = next((e for e in left if _matches(e, w)), None)
        if hit is None:
            return False
        left.remove(hit)
    return True

