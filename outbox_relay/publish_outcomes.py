"""What a publish answers, the same from every ``Outbox`` (the real one, publish.py, and the testing kit's
``FakeOutbox``, testing/fake.py, which tests/integration/test_outbox_contract.py holds to the same
scenarios): a ``Published`` per input, and the errors for an id already stored and for an idempotency
key that stands for another event."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import IdempotencyConflict, InvalidEvent
from .event import Event


@dataclass(frozen=True)
class Published:
    id: uuid.UUID
    created: bool  # False: the idempotency key was known; id is the event stored earlier


def results_per_input(results: Sequence[Published], where: Sequence[int] | None) -> list[Published]:
    """Results per input (``where``: each input's insert; None: one each): a repeat of an event already
    in the batch was not created by it."""
    if where is None:
        return list(results)
    seen: set[int] = set()
    out = []
    for i in where:
        out.append(results[i] if i not in seen else Published(results[i].id, False))
        seen.add(i)
    return out


def id_taken(event_id: Any) -> InvalidEvent:
    return InvalidEvent(
        f"invalid event: id: an event with the id {event_id} is already stored; ids are unique (leave id out for a "
        "new one; to publish an event again, give it the same idempotency_key); nothing of this call was written")


def key_stands_for_another(e: Event | dict[str, Any]) -> IdempotencyConflict:
    idempotency_key, topic = (e["idempotency_key"], e["topic"]) if isinstance(e, dict) else (e.idempotency_key, e.topic)
    return IdempotencyConflict(
        idempotency_key or "", topic,
        "already stands for another event, stored or in this batch (type, key or payload differ): a retry must "
        "publish the same event, a new event needs a new key; nothing of this call was written")


def key_just_taken(e: Event | dict[str, Any], what_happened: str) -> IdempotencyConflict:
    idempotency_key, topic = (e["idempotency_key"], e["topic"]) if isinstance(e, dict) else (e.idempotency_key, e.topic)
    return IdempotencyConflict(
        idempotency_key or "", topic,
        f"was just taken by a concurrent transaction for another event (its type, key or payload differ); "
        f"{what_happened}")
