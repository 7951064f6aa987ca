"""The contract kit's planned answers (``SinkContract``): wrappers in front of the sink under test that answer
for it on chosen calls (``Retry``, ``GiveUp``, an exception, ``SinkUnavailable``, a call that never returns)
and record what the engine was told was delivered. An async sink's wrapper (``AsyncFaultyEventSink``) is
async too, so that the adapter runs it as it runs the sink (lanes as tasks on its loop), and its call that
never returns awaits (it can be cancelled, as the sink's own would be)."""

from __future__ import annotations

import asyncio
import inspect
import threading
import uuid
from collections.abc import Sequence
from typing import Any

from ..sinks import Delivered, GiveUp, Retry, SinkEvent, SinkUnavailable
from ..sinks.engine import Commit, Failure, KeyHold, Outcomes
from ..sinks.waves import takes_waves
from ..store import StoredEvent

# What the kit answers for the sink on a planned attempt (``Plan``).
RETRY, GIVE_UP, RAISE, UNAVAILABLE, HANG = "retry", "give_up", "raise", "unavailable", "hang"


class Plan:
    """Per event id, what the kit answers on its next calls instead of the sink (one entry per call;
    calls, not attempts: ``SinkUnavailable`` counts no attempt)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.faults: dict[uuid.UUID, list[str]] = {}
        self.release = threading.Event()  # lets HANG calls return at the end of a test

    def set(self, event_id: uuid.UUID, *faults: str) -> None:
        with self.lock:
            self.faults[event_id] = list(faults)

    def next(self, event_id: uuid.UUID) -> str | None:
        """What ``fault`` would answer, without using it up."""
        with self.lock:
            planned = self.faults.get(event_id)
            return planned[0] if planned else None

    def fault(self, event_id: uuid.UUID) -> str | None:
        with self.lock:
            planned = self.faults.get(event_id)
            return planned.pop(0) if planned else None


class Recorder:
    """What the engine was told was delivered, in order (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ids: list[uuid.UUID] = []

    def add(self, ids: Sequence[uuid.UUID]) -> None:
        with self.lock:
            self.ids.extend(ids)

    def snapshot(self) -> list[uuid.UUID]:
        with self.lock:
            return list(self.ids)


class FaultyEventSink:
    """The user's EventSink with the kit's planned answers in front of it."""

    def __init__(self, inner: Any, plan: Plan, recorder: Recorder) -> None:
        self.inner, self.plan, self.recorder = inner, plan, recorder
        self.name, self.kind = inner.name, inner.kind
        self.topics = getattr(inner, "topics", None)
        self.types = getattr(inner, "types", None)
        self.concurrency = getattr(inner, "concurrency", 1)

    def deliver(self, event: SinkEvent) -> Any:
        fault = self.plan.fault(event.id)
        if fault == HANG:
            self.plan.release.wait()
            return None
        planned = self._planned(fault)
        if planned is not None:
            return planned
        result = self.inner.deliver(event)
        if inspect.isawaitable(result):
            return self._recorded_async(event, result)
        self._record(event, result)
        return result

    def _planned(self, fault: str | None) -> Any:
        """The kit's answer for ``fault`` (None: none, the sink answers); raises the planned exceptions."""
        if fault == RETRY:
            return Retry("contract: planned retry", after_seconds=0.3)
        if fault == GIVE_UP:
            return GiveUp("contract: planned give-up")
        if fault == RAISE:
            raise RuntimeError("contract: planned exception")
        if fault == UNAVAILABLE:
            raise SinkUnavailable("contract: planned outage", retry_after_seconds=0.2)
        return None

    async def _recorded_async(self, event: SinkEvent, awaitable: Any) -> Any:
        result = await awaitable
        self._record(event, result)
        return result

    def _record(self, event: SinkEvent, result: Any) -> None:
        if result is None or isinstance(result, Delivered):
            self.recorder.add([event.id])

    def idle(self) -> None:
        idle = getattr(self.inner, "idle", None)
        if idle is not None:
            idle()

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


class AsyncFaultyEventSink(FaultyEventSink):
    """``FaultyEventSink`` for a sink whose ``deliver`` is ``async def``."""

    async def deliver(self, event: SinkEvent) -> Any:  # async, as the sink's
        fault = self.plan.fault(event.id)
        if fault == HANG:
            while not self.plan.release.is_set():  # never returns in the test; a cancel ends it
                await asyncio.sleep(0.05)
            return None
        planned = self._planned(fault)
        if planned is not None:
            return planned
        return await self._recorded_async(event, self.inner.deliver(event))


class FaultyManySink(FaultyEventSink):
    """``FaultyEventSink`` for a sink with ``deliver_many`` (adapter.py's waves): the kit answers for the planned
    events of a call and passes the others on in one call; a planned exception is the whole call's, a planned
    outage that event's answer, a planned hang the whole call's."""

    def deliver_many(self, events: Sequence[SinkEvent]) -> list[Any]:
        answers: list[Any] = [None] * len(events)
        passed: list[int] = []
        ahead = [self.plan.next(event.id) for event in events]
        for whole in (HANG, RAISE):  # the call's own fault: only it is used up, the others' wait for their next call
            if whole in ahead:
                self.plan.fault(events[ahead.index(whole)].id)
                if whole == RAISE:
                    raise RuntimeError("contract: planned exception")
                self.plan.release.wait()
                return answers
        faults = [self.plan.fault(event.id) for event in events]
        for i, fault in enumerate(faults):
            if fault == UNAVAILABLE:
                answers[i] = SinkUnavailable("contract: planned outage", retry_after_seconds=0.2)
            elif fault is not None:
                answers[i] = self._planned(fault)
            else:
                passed.append(i)
        if passed:
            results = self.inner.deliver_many([events[i] for i in passed])
            for i, result in zip(passed, results, strict=True):
                answers[i] = result
                self._record(events[i], result)
        return answers


def faulty_event_sink(inner: Any, plan: Plan, recorder: Recorder) -> FaultyEventSink:
    """The kit's wrapper for a user's sink: async if its ``deliver`` is, with ``deliver_many`` if it has one."""
    if takes_waves(inner):
        return FaultyManySink(inner, plan, recorder)
    kind = AsyncFaultyEventSink if inspect.iscoroutinefunction(getattr(inner, "deliver", None)) else FaultyEventSink
    return kind(inner, plan, recorder)


class FaultyCommit:
    """The runner's commit with the kit's planned outcomes merged in; records what landed."""

    def __init__(self, commit: Commit, planned: Outcomes, recorder: Recorder, events: Sequence[StoredEvent]) -> None:
        self.commit, self.planned, self.recorder = commit, planned, recorder
        self.bucket = {e.id: e.bucket for e in events}

    def partial(self, outcomes: Outcomes) -> set[int]:
        return self.commit.partial({**outcomes, **self.planned})

    def later(self, outcomes: Outcomes) -> set[int]:
        return self(outcomes, None)  # at once: what landed is recorded

    def __call__(self, outcomes: Outcomes, tx: Any) -> set[int]:
        landed = self.commit({**outcomes, **self.planned}, tx)
        self._record(outcomes, landed)
        return landed

    async def in_async(self, outcomes: Outcomes, tx: Any) -> set[int]:
        landed = await self.commit.in_async({**outcomes, **self.planned}, tx)
        self._record(outcomes, landed)
        return landed

    def _record(self, outcomes: Outcomes, landed: set[int]) -> None:
        self.recorder.add([i for i, o in outcomes.items() if o is None and self.bucket.get(i) in landed])


class FaultyEngineSink:
    """An engine ``Sink`` (Kafka, projections, RecordingSink) with the kit's planned failures: a planned
    event is answered by the kit (and its key's later events of the batch left out, as the sink would),
    the rest goes to the sink."""

    def __init__(self, inner: Any, plan: Plan, recorder: Recorder) -> None:
        self.inner, self.plan, self.recorder = inner, plan, recorder
        self.name, self.kind, self.event_filter = inner.name, inner.kind, inner.event_filter

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        planned: Outcomes = {}
        hold = KeyHold()
        passed: list[StoredEvent] = []
        for e in events:
            if not hold.allows(e):
                continue  # behind a planned failure of its key: the sink never sees it
            fault = self.plan.fault(e.id)
            if fault is None:
                passed.append(e)
                continue
            failure = {RETRY: Failure("contract: planned retry", retry_after=0.3),
                       GIVE_UP: Failure("contract: planned give-up", retriable=False),
                       UNAVAILABLE: Failure("contract: planned outage", hold_seconds=0.2)}[fault]
            planned[e.id] = failure
            hold.record(e, failure)
        landed: set[int] = self.inner.deliver(passed, fences, FaultyCommit(commit, planned, self.recorder, events),
                                              abort)
        return landed

    def idle(self) -> None:
        idle = getattr(self.inner, "idle", None)
        if idle is not None:
            idle()

    def close(self) -> None:
        self.inner.close()

