"""``FakeOutbox``: an ``Outbox`` that keeps events in memory, for code tested without PostgreSQL."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from decimal import Decimal
from typing import Any

from outbox_relay.event import Event
from outbox_relay.publish import Outbox
from outbox_relay.publish_outcomes import Published, id_taken, key_stands_for_another, results_per_input

from .published_event import PublishedEvent

# -- the in-memory fake ----------------------------------------------------------------------------

_Scope = tuple[str, str]  # (topic or "", idempotency key): where an idempotency key is unique
_Fingerprint = tuple[str, str, Any]  # type, key, canonical payload: what makes two events "the same"


class FakeOutbox(Outbox):
    """An ``Outbox`` that keeps what it publishes in memory, for code tested without PostgreSQL.

    ``publish``, ``publish_many``, ``apublish`` and ``apublish_many`` take the same arguments and
    refuse the same input with the same errors as ``Outbox``: ``InvalidEvent`` naming the problem;
    ``IdempotencyConflict`` when an idempotency key of a topic already stands for another event
    (type, key or payload differ, payloads compared as PostgreSQL's jsonb does: ``1`` and ``1.0``
    differ, the order of object keys does not); a repeated key for the same event returns the first
    one with ``created=False``. A call that raises records nothing. ``events`` lists what was
    recorded, in publish order; the module's helpers (``published``, ``assert_published``, ...)
    take a FakeOutbox where they take a connection.

    The connection argument is not used (pass None, or whatever the code under test has). There are
    no transactions: an event is recorded at once and stays when the caller's transaction would roll
    back, and nothing is relayed.
    """

    def __init__(self, default_topic: str | None = None) -> None:
        super().__init__(default_topic)
        self._log: list[PublishedEvent] = []
        self._ids: set[uuid.UUID] = set()
        self._idempotent: dict[_Scope, tuple[uuid.UUID, _Fingerprint]] = {}

    @property
    def events(self) -> list[PublishedEvent]:
        """Every event recorded, in publish order (a copy)."""
        return list(self._log)

    def clear(self) -> None:
        """Forget every event (idempotency keys included), as a fresh database would."""
        self._log.clear()
        self._ids.clear()
        self._idempotent.clear()

    def publish_many(self, conn: Any, events: Iterable[Event | dict[str, Any]]) -> list[Published]:
        """``Outbox.publish_many``, recorded in memory (``conn`` is not used)."""
        return self._record(events)

    async def apublish_many(self, conn: Any, events: Iterable[Event | dict[str, Any]]) -> list[Published]:
        """``Outbox.apublish_many``, recorded in memory (``conn`` is not used)."""
        return self._record(events)

    def _record(self, events: Iterable[Event | dict[str, Any]]) -> list[Published]:
        """What sql/queries/publish.sql does, in memory: one conflict refuses the whole call; a known
        idempotency key (stored, or earlier in the batch) yields that event, created=False."""
        batch, where = self._distinct(self._events(events))
        payloads = [r["payload"] for r in self._rows(batch)]  # Outbox's checks: JSON, text PostgreSQL can store
        prints = [(e.type, e.key, _canonical(p)) for e, p in zip(batch, payloads, strict=True)]
        in_batch: dict[_Scope, set[_Fingerprint]] = {}
        for e, fp in zip(batch, prints, strict=True):
            if e.idempotency_key is not None:
                in_batch.setdefault((e.topic or "", e.idempotency_key), set()).add(fp)
        for e, fp in zip(batch, prints, strict=True):
            if e.idempotency_key is None:
                continue
            scope = (e.topic or "", e.idempotency_key)
            known = self._idempotent.get(scope)
            if (known is not None and known[1] != fp) or len(in_batch[scope]) > 1:
                raise key_stands_for_another(e)
        results: list[Published] = []
        new: list[tuple[Event, str, _Fingerprint]] = []
        first: dict[_Scope, uuid.UUID] = {}
        for e, payload, fp in zip(batch, payloads, prints, strict=True):
            slot = (e.topic or "", e.idempotency_key) if e.idempotency_key is not None else None
            if slot is not None and slot in self._idempotent:
                results.append(Published(self._idempotent[slot][0], False))
            elif slot is not None and slot in first:
                results.append(Published(first[slot], False))
            else:
                if slot is not None:
                    first[slot] = e.id
                new.append((e, payload, fp))
                results.append(Published(e.id, True))
        for e, _, _ in new:
            if e.id in self._ids:
                # What Outbox raises (its statement finds the id stored and inserts nothing).
                raise id_taken(e.id)
        for e, payload, fp in new:
            self._ids.add(e.id)
            if e.idempotency_key is not None:
                self._idempotent[(e.topic or "", e.idempotency_key)] = (e.id, fp)
            self._log.append(PublishedEvent(
                id=e.id, type=e.type, key=e.key, topic=e.topic, payload=json.loads(payload), headers=dict(e.headers),
                idempotency_key=e.idempotency_key, time=e.time, position=(0, len(self._log) + 1)))
        return results_per_input(results, where)


def _canonical(payload: str) -> Any:
    """A JSON text as jsonb's equality sees it (outbox.fingerprint_v1 hashes jsonb's text): object key
    order and duplicate keys do not count, numbers keep their scale (``1`` is not ``1.0``, ``1e2``
    is ``100``, ``-0.0`` is ``0.0``)."""
    return _freeze(json.loads(payload, parse_float=_numeric, parse_int=_numeric))


def _numeric(literal: str) -> tuple[str, str]:
    d = Decimal(literal)
    exponent = d.as_tuple().exponent
    scale = max(0, -exponent) if isinstance(exponent, int) else 0
    return ("numeric", f"{abs(d) if d.is_zero() else d:.{scale}f}")


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return ("object", frozenset((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("array", tuple(_freeze(v) for v in value))
    return value  # str, bool, None, or a numeric tuple

