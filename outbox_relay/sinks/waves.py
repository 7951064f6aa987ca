"""The lane of a sink that sends several events in one call (``deliver_many``: Redis pipelines them).

Such a sink gets one lane thread per batch (adapter.py), and the lane sends waves: each call holds the next
event of each of up to ``concurrency`` keys, never two events of one key, so that whatever a wave's answers
are, no key's later event can land before an earlier one that will be retried. A key whose event will be
retried drops out of the run (its later events are not attempted); the others come round again, behind the
keys that waited. One call answers for its wave: an exception, or a call past the time limit, is charged to
each of its events; a ``SinkUnavailable`` (raised, or an event's answer) stops the run after the wave, with
what else the wave delivered recorded. The rules for each answer are the thread lanes' (``Run.record``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..dsn import describe_error
from ..store import StoredEvent
from .engine import Failure
from .user import SinkEvent, SinkUnavailable

Answer = Failure | SinkUnavailable | None


class Run(Protocol):
    """What the wave lane uses of the adapter's run of one batch (guarded by ``cond``)."""

    keys: deque[list[StoredEvent]]
    cond: threading.Condition
    active: set[Any]
    unavailable: SinkUnavailable | None
    closed: bool
    handler_many: Callable[[list[SinkEvent], None], Any] | None

    def record(self, e: StoredEvent, result: Answer, todo: deque[StoredEvent]) -> bool: ...


class Lane(Protocol):
    event: StoredEvent | None
    since: float
    detached: bool
    wave: Sequence[StoredEvent]  # the call's events, charged together if it is abandoned


def takes_waves(sink: object) -> bool:
    """Whether the relay calls ``sink.deliver_many``: it has one, and no ``deliver`` below it in the class
    hierarchy (or on the instance) overrides the one beside it. A subclass of a product sink that wraps
    ``deliver`` (to log, to count) is called as it says, one event at a time."""
    if not callable(getattr(sink, "deliver_many", None)):
        return False
    own = getattr(sink, "__dict__", {})
    if "deliver" in own or "deliver_many" in own:
        return "deliver_many" in own
    mro = type(sink).__mro__

    def defined_at(name: str) -> int:
        return next((i for i, c in enumerate(mro) if name in vars(c)), len(mro))

    return defined_at("deliver_many") <= defined_at("deliver")


def work(run: Run, lane: Lane, concurrency: int) -> None:
    """On the lane's thread: waves until no key is left or the run stops."""
    run.cond.acquire()
    try:
        while run.keys and not (run.closed or lane.detached or run.unavailable is not None):
            keys = [run.keys.popleft() for _ in range(min(len(run.keys), concurrency))]
            wave = [events[0] for events in keys]
            lane.wave, lane.event, lane.since = wave, wave[0], time.monotonic()
            run.cond.release()
            try:
                answers = call_many(run.handler_many, wave)
            finally:
                run.cond.acquire()
            lane.wave, lane.event = (), None
            if lane.detached:
                return  # abandoned: the runner already charged the wave
            for events, e, answer in zip(keys, wave, answers, strict=True):
                todo = deque(events[1:])
                run.record(e, answer, todo)  # a retry clears the key's todo; unavailable ends the loop
                if todo:
                    run.keys.append(list(todo))
    finally:
        run.active.discard(lane)
        run.cond.notify_all()
        run.cond.release()


def call_many(handler: Callable[[list[SinkEvent], None], Any] | None, wave: Sequence[StoredEvent]) -> list[Answer]:
    """One ``deliver_many`` call for ``wave``: an answer per event. Never raises."""
    from .adapter import outcome_of, sink_event  # the per-event rules, shared with the thread lanes

    assert handler is not None, "a wave lane runs only for a sink with deliver_many"
    answers: list[Answer] = []
    given: list[int] = []  # which of the wave the sink is given (a row that is not an event is not)
    events: list[SinkEvent] = []
    for i, e in enumerate(wave):
        event = sink_event(e)
        answers.append(event if isinstance(event, Failure) else None)
        if not isinstance(event, Failure):
            given.append(i)
            events.append(event)
    if not events:
        return answers
    mapped: list[Answer]
    try:
        results = handler(events, None)
    except SinkUnavailable as exc:
        mapped = [exc] * len(events)
    except BaseException as exc:  # as a deliver's: the wave's attempts failed (SystemExit too), the lane goes on
        mapped = [Failure(describe_error(exc))] * len(events)
    else:
        if isinstance(results, list | tuple) and len(results) == len(events):
            # The sink's own answers, each by the thread lanes' rules (an engine Failure included: a bug, retried).
            mapped = [r if isinstance(r, SinkUnavailable) else outcome_of(r) for r in results]
        else:
            shape = f"{len(results)} answers" if isinstance(results, list | tuple) else f"a {type(results).__name__}"
            mapped = [Failure(f"the sink's deliver_many returned {shape} for {len(events)} events: expected a list "
                              "of one answer per event (a bug in the sink; retried)")] * len(events)
    for i, answer in zip(given, mapped, strict=True):
        answers[i] = answer
    return answers


__all__ = ["Lane", "Run", "call_many", "takes_waves", "work"]
