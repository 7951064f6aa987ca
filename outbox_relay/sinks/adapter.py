"""A user's ``EventSink`` (user.py) as the engine's ``Sink`` (engine.py): every guarantee is kept here.

Per batch, the events are grouped by key (in batch order, which is publish order per key) and the
keys are handed to ``concurrency`` lanes, threads that call the user's ``deliver`` one event at a time
for one key at a time (an ``async def deliver``'s lanes are tasks on the sink's event loop: tasks.py,
loop.py). A sink with ``deliver_many`` (a broker that pipelines: Redis, SQS) gets one lane that sends
waves instead, each the next event of up to ``concurrency`` keys in one call (waves.py). A key stops at
its first failure that will be retried (its later events are not attempted: the checkpoint parks them
behind it, so order holds); a ``GiveUp`` lets it go on. A
``SinkUnavailable`` stops the whole batch: what was not attempted waits (held, no attempt counted),
and the next batches are held without calling the sink until the wait is over.

The runner thread (the one the engine calls ``deliver`` on) only waits, looking at the stop flag and
the clock every ``WAIT_SLICE`` (each look also tells the engine it is alive). A call that has not
returned within ``handler_timeout_seconds`` is abandoned (timelimit.py): Python can not kill a thread,
so the lane is left to it (whatever it returns is ignored), the event is charged a failed attempt, and
a new lane takes over the remaining keys. Past the process's cap of threads left to calls that never
returned (``timelimit.MAX_ABANDONED``, counted with projections' and the inbox's), the batch is
checkpointed and then ``SinkStuck`` stops the relay (exit 4), so that a fresh process takes over
instead of piling up threads. An async call past the limit is cancelled; one that goes on is counted
the same way, and so is a loop a call blocks past the limit: it is replaced, the calls in flight there
charged, and the other keys go on on a new loop.

Once every lane is done with a batch, ``commit`` writes its outcomes, fenced, once (the engine's rules
for parking, backoff, dead letters and metrics apply). A batch that takes longer than
``PARTIAL_CHECKPOINT_SECONDS`` (slow calls) has what is delivered of it checkpointed early, every that
often (``Commit.partial``), so that a crash or a lost lease hands over only the rest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

from ..dsn import describe_error, redact
from ..errors import MAX_ERROR_CHARS, SinkStuck
from ..observer import NULL_OBSERVER, Observer
from ..store import EventFilter, StoredEvent
from ..timelimit import WAIT_SLICE, HandlerThread, cap_exceeded
from . import tasks, waves
from .engine import PARTIAL_CHECKPOINT_SECONDS, Aborted, Commit, EarlyCheckpoints, Failure, Outcomes
from .loop import Raised, SinkLoop
from .tasks import TaskLane
from .user import MAX_WAIT_SECONDS, Delivered, EventSink, GiveUp, Retry, SinkEvent, SinkUnavailable, check_sink

log = logging.getLogger("outbox_relay.sinks")


_ANSWERS = (Delivered, Retry, GiveUp)
# An async sink's loop that ran nothing else for longer than the time limit, and at least this long, is given
# up on: a loaded machine can delay a quiet loop's beat by a fraction of a second, and a call that blocks
# it is charged at its own time limit anyway (the floor only delays the other keys' move to a new loop).
MIN_BLOCKED_SECONDS = 1.0


def sink_event(e: StoredEvent) -> SinkEvent | Failure:
    """The event as the user's sink is given it, or why it can not be (never retried: the row never
    changes). Rows written before migration 0005's trigger may hold headers of any JSON shape."""
    headers: dict[str, str] = {}
    if e.headers_text != "{}":
        try:
            value = json.loads(e.headers_text)
        except ValueError as exc:
            return Failure(f"the event's headers are not JSON: {exc}", retriable=False)
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            return Failure("the event's headers must be a JSON object of strings", retriable=False)
        headers = value
    return SinkEvent(id=e.id, topic=e.topic, key=e.key, type=e.type, payload_json=e.payload_text,
                     headers=MappingProxyType(headers), time=e.time, version=e.version, attempt=e.attempts + 1)


def _reason(text: object, default: str) -> str:
    try:
        reason = str(text).strip() if text is not None else ""
    except Exception:  # a reason object whose __str__ raises: the answer still counts, with a reason that says so
        reason = f"<a {type(text).__name__} whose str() failed>"
    return redact(reason or default)[:MAX_ERROR_CHARS]


def _seconds(value: object) -> float | None:
    """``value`` as a wait in seconds if it is a finite number >= 0 (bool aside), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    seconds = float(value)
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def outcome_of(result: object) -> Failure | None:
    """What the engine makes of ``deliver``'s answer. Never raises: an answer that breaks the rules (a
    subclass that skipped the checks) is a bug of the sink, retried like an exception."""
    if result is None or isinstance(result, Delivered):
        return None
    if isinstance(result, Retry):
        after = getattr(result, "after_seconds", None)
        if after is None:
            return Failure(_reason(getattr(result, "reason", None), "the sink asked for a retry"))
        seconds = _seconds(after)
        if seconds is None:
            return Failure(f"the sink's deliver returned a Retry with after_seconds {_reason(repr(after), '?')[:50]}: "
                           "expected a finite number >= 0 or None (a bug in the sink; retried)")
        return Failure(_reason(getattr(result, "reason", None), "the sink asked for a retry"),
                       retry_after=min(seconds, MAX_WAIT_SECONDS))
    if isinstance(result, GiveUp):
        return Failure(_reason(getattr(result, "reason", None), "the sink gave up on the event"), retriable=False)
    return Failure(f"the sink's deliver returned a {type(result).__name__}: expected Delivered, Retry, GiveUp or None "
                   "(a bug in the sink; retried)")


def unavailable_wait(unavailable: SinkUnavailable) -> float:
    """How long a ``SinkUnavailable`` holds the sink (a subclass that skipped ``__init__``: the default 5 s)."""
    seconds = _seconds(getattr(unavailable, "retry_after_seconds", None))
    return min(5.0 if seconds is None else seconds, MAX_WAIT_SECONDS)


def held(unavailable: SinkUnavailable, wait: float) -> Failure:
    reason = _reason(getattr(unavailable, "reason", None), "no reason given")
    return Failure(f"the sink is unavailable: {reason} (a condition of the sink: the event waits, no attempt "
                   "counted)", hold_seconds=max(0.0, wait))


class _Lane(HandlerThread):
    """A thread that calls the user's ``deliver``. Reused from batch to batch until it is abandoned.
    ``event``/``since``/``detached`` are guarded by the condition of the run it works on."""

    def __init__(self, adapter: EventSinkAdapter, number: int) -> None:
        self.adapter = adapter
        self.event: StoredEvent | None = None  # whose call runs now
        self.since = 0.0  # when that call began (monotonic)
        # An async sink's call in flight on the adapter's event loop (cancelled if the call is abandoned).
        self.future: concurrent.futures.Future[Any] | None = None
        self.wave: Sequence[StoredEvent] = ()  # a deliver_many call's events (``event`` is the first of them)
        super().__init__(f"sink-{adapter.name}-{number}")

    def take(self, run: _Run) -> None:
        self.submit(lambda: run.context.copy().run(run.work, self))

    def idle(self) -> None:
        self.adapter.returned(self)  # free for the next batch


class _Run:
    """One batch's delivery: the keys still to do, what became of each event, which lanes work on it."""

    def __init__(self, adapter: EventSinkAdapter, events: Sequence[StoredEvent]) -> None:
        self.adapter = adapter
        by_key: dict[str, list[StoredEvent]] = {}
        for e in events:
            by_key.setdefault(e.key, []).append(e)
        self.keys: deque[list[StoredEvent]] = deque(by_key.values())
        self.outcomes: Outcomes = {}
        self.cond = threading.Condition(threading.Lock())
        self.active: set[_Lane | TaskLane] = set()
        self.unavailable: SinkUnavailable | None = None  # a lane's call raised it: nothing more is attempted
        self.closed = False  # a hard stop: nothing more is attempted, nothing recorded
        self.context = contextvars.copy_context()  # the runner's (the batch's span): calls are traced under it
        self.handler = adapter.handler()
        self.handler_many = adapter.handler_many() if adapter.many else None

    def work(self, lane: _Lane) -> None:
        """On a lane: take keys and deliver their events in order until none is left or the run stops.
        One hold of the condition per event: record the last call's outcome and take the next event."""
        if self.adapter.many:
            return waves.work(self, lane, self.adapter.concurrency)
        todo: deque[StoredEvent] = deque()  # the rest of this lane's current key
        self.cond.acquire()
        try:
            while not self._stopped(lane):
                if not todo:
                    if not self.keys:
                        return
                    todo.extend(self.keys.popleft())
                e = todo.popleft()
                lane.event, lane.since = e, time.monotonic()
                self.cond.release()
                try:
                    result = self._call(e, lane)
                finally:
                    self.cond.acquire()
                lane.event = None
                if lane.detached:
                    return  # abandoned: the runner already charged this call
                if self.record(e, result, todo):
                    return
        finally:
            self.active.discard(lane)
            self.cond.notify_all()
            self.cond.release()

    def record(self, e: StoredEvent, result: Failure | SinkUnavailable | None, todo: deque[StoredEvent]) -> bool:
        """A lane's call for ``e`` returned ``result`` (under ``cond``; thread and task lanes alike): True when
        the lane stops, because the sink said it is unavailable and nothing more is attempted."""
        if isinstance(result, SinkUnavailable):
            self.unavailable = result
            return True
        self.outcomes[e.id] = result
        if result is not None and result.retriable:
            todo.clear()  # the key waits for this event's retry: its later events are not attempted
        return False

    def call(self, e: StoredEvent) -> Any:
        """An async sink's call for ``e`` (a TaskLane awaits it), or why the event can not be given."""
        event = sink_event(e)
        return event if isinstance(event, Failure) else self.handler(event, None)

    def outcome(self, result: object) -> Failure | None:
        return outcome_of(result)

    def _stopped(self, lane: _Lane) -> bool:
        return self.closed or lane.detached or self.unavailable is not None

    def _call(self, e: StoredEvent, lane: _Lane) -> Failure | SinkUnavailable | None:
        event = sink_event(e)
        if isinstance(event, Failure):
            return event
        try:
            result = self.handler(event, None)
            if result is not None and not isinstance(result, _ANSWERS) and inspect.isawaitable(result):
                # One event loop per sink for every lane's calls, so that a client the sink keeps (an HTTP
                # session, a connection pool) serves them all; the lane waits for its call there.
                lane.future = self.adapter.sink_loop().call(result, contextvars.copy_context())
                result = lane.future.result()
        except SinkUnavailable as exc:
            return exc
        except Raised as exc:
            return Failure(describe_error(exc.raised))
        except Exception as exc:  # the event's attempt failed; one failure never kills the lane
            return Failure(describe_error(exc))
        except BaseException as exc:  # SystemExit, KeyboardInterrupt from a sink's own code: charged to the
            return Failure(describe_error(exc))  # event like any error (unrecorded, it would come back forever)
        finally:
            lane.future = None
        return outcome_of(result)


class EventSinkAdapter:
    """Runs a user's ``EventSink`` for a relay: the engine's ``Sink`` around it."""

    def __init__(self, sink: EventSink, *, handler_timeout_seconds: float = 30.0, where: str = "") -> None:
        self.user = check_sink(sink, where)
        self.name: str = sink.name
        self.kind: str = sink.kind
        topics = getattr(sink, "topics", None)
        types = getattr(sink, "types", None)
        self.event_filter: EventFilter | None = None if topics is None and types is None else EventFilter(
            types=None if types is None else tuple(sorted(types)),
            topics=None if topics is None else tuple(sorted(topics)))
        self.concurrency: int = getattr(sink, "concurrency", 1)
        # Lanes as tasks on the sink's event loop (tasks.py); a sync deliver (even one returning an
        # awaitable) keeps lane threads.
        self.tasks = inspect.iscoroutinefunction(self.user.deliver)
        self.many = waves.takes_waves(sink)  # waves on one lane (waves.py)
        self.timeout = handler_timeout_seconds
        self.partial_seconds = PARTIAL_CHECKPOINT_SECONDS
        self.observer: Observer = NULL_OBSERVER  # set by the composition root (tracing: a span per call)
        # Lanes free for the next batch; the runner takes them, lanes put themselves back (hence the lock).
        self._lock = threading.Lock()
        self._idle: list[_Lane] = []
        self._lanes_made = 0
        # The sink said it is unavailable: batches are held without calling it until then (runner thread only).
        self._unavailable_until = 0.0
        self._unavailable: SinkUnavailable | None = None
        self._over_cap = False
        self._loop: SinkLoop | None = None  # an async sink's, on a thread of its own (guarded by _lock)

    def sink_loop(self) -> SinkLoop:
        """The event loop an async sink's calls run on (started on first use; a new one once the last was
        given up on)."""
        with self._lock:
            if self._loop is None or not self._loop.running:
                self._loop = SinkLoop(self.name)
            return self._loop

    def event_loop(self) -> asyncio.AbstractEventLoop:
        return self.sink_loop().loop

    def handler(self) -> Callable[[SinkEvent, None], Any]:
        """The user's ``deliver`` as the observer wraps it (a span per call), in the (event, tx) shape
        observers know from projection handlers."""
        deliver = self.user.deliver
        if inspect.iscoroutinefunction(deliver):
            async def call_async(event: SinkEvent, _tx: None) -> Any:
                return await deliver(event)
            return self.observer.handler(self.name, call_async)

        def call(event: SinkEvent, _tx: None) -> Any:
            return deliver(event)
        return self.observer.handler(self.name, call)

    def handler_many(self) -> Callable[[list[SinkEvent], None], Any]:
        """The user's ``deliver_many`` as the observer wraps it (one span per call, as a batched handler's)."""
        deliver_many = self.user.deliver_many  # type: ignore[attr-defined]  # self.many says it is there

        def call(events: list[SinkEvent], _tx: None) -> Any:
            return deliver_many(events)
        return self.observer.handler(self.name, call)

    # -- the engine's Sink --------------------------------------------------------------------

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        if not events:
            return commit({}, None)  # only events queued behind parked keys
        now = time.monotonic()
        if self._unavailable is not None and now < self._unavailable_until:
            failure = held(self._unavailable, self._unavailable_until - now)
            return commit({e.id: failure for e in events}, None)
        run = _Run(self, events)
        with run.cond:
            self._start_lanes(run, 1 if self.many else min(self.concurrency, len(run.keys)))
            # The runner's commit checkpoints the delivered part of a long batch early; another may write nothing.
            self._wait(run, abort, commit.partial)
        outcomes = run.outcomes
        if run.unavailable is not None:
            wait = unavailable_wait(run.unavailable)
            self._unavailable, self._unavailable_until = run.unavailable, time.monotonic() + wait
            failure = held(run.unavailable, wait)
            log.warning("sink %s: unavailable: %s; its events wait %.1fs (no attempt counted)", self.name,
                        _reason(getattr(run.unavailable, "reason", None), "no reason given"), wait)
            for e in events:
                outcomes.setdefault(e.id, failure)
        else:
            self._unavailable = None
        landed = commit(outcomes, None)
        self._check_cap()
        return landed

    def _start_lanes(self, run: _Run, count: int) -> None:
        """Put ``count`` lanes on ``run`` (the caller holds ``run.cond``): tasks on the sink's loop, handed over
        in one hop, or threads."""
        if self.tasks:
            while count > 0 and not tasks.start(self.sink_loop(), run, count):
                pass  # the loop was just given up on: the next one takes them
            return
        for _ in range(count):
            self._start_lane(run)

    def _start_lane(self, run: _Run) -> None:
        with self._lock:
            lane = self._idle.pop() if self._idle else None
            if lane is None:
                self._lanes_made += 1
                lane = _Lane(self, self._lanes_made)
        run.active.add(lane)
        lane.take(run)

    def returned(self, lane: _Lane) -> None:
        """A lane finished its run (on the lane's thread): free for the next batch."""
        with self._lock:
            self._idle.append(lane)

    def _wait(self, run: _Run, abort: threading.Event, partial: Callable[[Outcomes], set[int]] | None) -> None:
        """Until the lanes are done with ``run`` (the caller holds ``run.cond``): abandon calls past the
        limit, checkpoint what is delivered every ``partial_seconds``, raise Aborted on a hard stop."""
        early = EarlyCheckpoints(self.name, partial, self.partial_seconds)
        while run.active:
            run.cond.wait(WAIT_SLICE)
            if abort.is_set():  # each check also tells the engine this thread is alive
                run.closed = True
                for lane in run.active:
                    lane.detach()  # it ends after its call; nothing of it is recorded
                raise Aborted()
            now = time.monotonic()
            if self.tasks:
                self._check_loop(run)
            for lane in [lane for lane in run.active if lane.event is not None and now - lane.since > self.timeout]:
                self._abandon(run, lane)
            if early.due() and run.active:
                settled = dict(run.outcomes)
                run.cond.release()  # the lanes go on recording while the checkpoint is written
                try:
                    early.write(settled)
                finally:
                    run.cond.acquire()

    def _check_loop(self, run: _Run) -> None:
        """The event loop of ``run``'s task lanes ran nothing else for longer than the time limit (a call blocks
        it), or takes no more work: its lanes are left, the calls in flight charged, and the other keys go on
        on a new loop (a blocked one is stopped, and counted against the cap while its thread lives)."""
        for sink_loop in {lane.loop for lane in run.active if isinstance(lane, TaskLane)}:
            blocked = sink_loop.blocked_for()
            if sink_loop.running and blocked <= max(self.timeout, MIN_BLOCKED_SECONDS):
                continue
            why = (f"ran nothing else for {blocked:.1f}s (a call blocks it)" if sink_loop.running
                   else "was stopped")
            for lane in [lane for lane in run.active if isinstance(lane, TaskLane) and lane.loop is sink_loop]:
                lane.detach()
                run.active.discard(lane)
                if lane.event is not None:
                    run.outcomes[lane.event.id] = Failure(f"the sink's event loop {why} during this call of deliver "
                                                          f"(--handler-timeout-seconds {self.timeout:g}); the call "
                                                          "was abandoned")
            with self._lock:
                if self._loop is sink_loop:
                    self._loop = None  # the next lane starts a new one
            if sink_loop.running:
                self._over_cap |= sink_loop.abandon()  # if its call ever returns, the loop ends
            log.warning("sink %s: its event loop %s; abandoned, the calls in flight charged, a new loop takes over",
                        self.name, why)
            if run.keys and run.unavailable is None:
                self._start_lanes(run, min(self.concurrency, len(run.keys)))

    def _abandon(self, run: _Run, lane: _Lane | TaskLane) -> None:
        e = lane.event
        assert e is not None
        if lane.abandon():  # if its call ever returns, the thread ends (a task lane's call is cancelled)
            self._over_cap = True
        if isinstance(lane, _Lane) and lane.future is not None:
            lane.future.cancel()  # an async call can be cancelled (if it awaits), which frees its lane too
        run.active.discard(lane)
        for charged in getattr(lane, "wave", ()) or (e,):  # a deliver_many call answers for its whole wave
            run.outcomes[charged.id] = Failure(f"the sink's deliver did not return within {self.timeout:g}s "
                                               "(--handler-timeout-seconds); the call was abandoned")
        log.warning("sink %s: deliver of event %s (key %r) did not return within %gs; abandoned, the attempt counted",
                    self.name, e.id, e.key, self.timeout)
        if run.keys and run.unavailable is None:
            self._start_lanes(run, 1)  # the other keys go on

    def _check_cap(self) -> None:
        """After the batch that charged them landed: too many threads left to calls that never returned."""
        over, self._over_cap = self._over_cap, False
        if over and (why := cap_exceeded("calls of deliver")):
            raise SinkStuck(f"sink {self.name}: {why}")

    def problem(self, timeout: float = 2.0) -> str | None:
        """Why the sink can not deliver now (for /readyz): it said it is unavailable, and the wait is not over."""
        unavailable, until = self._unavailable, self._unavailable_until
        left = until - time.monotonic()
        if unavailable is None or left <= 0:
            return None
        return (f"unavailable: {_reason(getattr(unavailable, 'reason', None), 'no reason given')} (its events wait, "
                f"{left:.0f}s more)")

    def idle(self) -> None:
        """The user's ``idle()``, if it has one (runner thread, between batches)."""
        idle: Callable[[], None] | None = getattr(self.user, "idle", None)
        if idle is not None:
            try:
                idle()
            except Exception:
                raise  # logged by the runner's wait (sink.wait_idle), which goes on
            except BaseException as exc:  # SystemExit from the sink's own code would end the runner's thread
                raise RuntimeError(f"idle() raised {describe_error(exc)}") from None

    def close(self) -> None:
        with self._lock:
            lanes, self._idle = self._idle, []
        for lane in lanes:
            lane.close()
        close: Callable[[], None] | None = getattr(self.user, "close", None)
        if close is not None:
            try:
                close()
            except BaseException as exc:  # SystemExit too: the relay still releases its leases and leaves
                log.warning("sink %s: close failed: %s", self.name, describe_error(exc))
        with self._lock:
            sink_loop, self._loop = self._loop, None
        if sink_loop is not None:
            sink_loop.stop(5.0)  # what is left there is cancelled, then the loop closed on its thread


__all__ = ["EventSinkAdapter", "sink_event"]
