"""The engine's observer guard (observer.guarded): a hook that raises is logged at most once a minute per
hook and costs the engine nothing else; a batch's own exception goes through a delivering scope as before."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from outbox_relay import observer as observer_module
from outbox_relay.observer import NULL_OBSERVER, Delivery, Guarded, Observer, Observers, guarded


class Broken(Observer):
    """Every hook raises (a bug in a user's metrics code); counts the calls."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def _raise(self, hook: str) -> None:
        self.calls[hook] += 1
        raise RuntimeError(f"{hook} is broken")

    def batch(self, sink: str, **_: Any) -> None:
        self._raise("batch")

    def ages(self, sink: str, seconds: Sequence[float]) -> None:
        self._raise("ages")

    def checkpointed(self, sink: str, **_: Any) -> None:
        self._raise("checkpointed")

    def acknowledged(self, sink: str, event_ids: Sequence[uuid.UUID]) -> None:
        self._raise("acknowledged")

    def held(self, sink: str, events: int) -> None:
        self._raise("held")

    def leases(self, sink: str, **_: Any) -> None:
        self._raise("leases")

    def cycle_failed(self, sink: str, error: str) -> None:
        self._raise("cycle_failed")

    def producer_recreated(self, sink: str, reason: str) -> None:
        self._raise("producer_recreated")

    def housekeeping(self, **_: Any) -> None:
        self._raise("housekeeping")

    def handler(self, sink: str, handler: Any) -> Any:
        self._raise("handler")


def call_every_hook(o: Observer) -> None:
    o.batch("s", size=1, delivered=1, retried=0, dead=0, latencies=[0.1])
    o.ages("s", [0.1])
    o.checkpointed("s", delivered=[uuid.uuid4()], dead=[])
    o.acknowledged("s", [uuid.uuid4()])
    o.held("s", 1)
    o.leases("s", acquired=1)
    o.cycle_failed("s", "boom")
    o.producer_recreated("s", "amnesia")
    o.housekeeping(seconds=0.1, dead_workers=0, expired_leases=0, deleted_events=0)
    assert o.handler("s", print) is print


HOOKS = {"batch", "ages", "checkpointed", "acknowledged", "held", "leases", "cycle_failed", "producer_recreated",
         "housekeeping", "handler"}


def errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "outbox_relay.observer" and r.levelno == logging.ERROR]


def test_a_raising_hook_is_logged_once_a_minute_per_hook_and_never_raises(caplog: pytest.LogCaptureFixture,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    broken = Broken()
    o = guarded(broken)
    with caplog.at_level(logging.ERROR, logger="outbox_relay.observer"):
        for _ in range(100):
            call_every_hook(o)
    assert broken.calls == Counter({h: 100 for h in HOOKS}), "every call still reaches the observer"
    logged = errors(caplog)
    assert len(logged) == len(HOOKS), [r.getMessage() for r in logged]
    assert all(r.exc_info and "is broken" in str(r.exc_info[1]) for r in logged), "with the traceback"
    assert {h for h in HOOKS if any(f" {h} raised" in r.getMessage() for r in logged)} == HOOKS
    caplog.clear()
    monkeypatch.setattr(observer_module, "FAILURE_LOG_SECONDS", 0.0)
    with caplog.at_level(logging.ERROR, logger="outbox_relay.observer"):
        o.batch("s", size=1, delivered=1, retried=0, dead=0, latencies=[])
    [again] = errors(caplog)
    assert "batch raised (99 more times since it was last logged)" in again.getMessage()


def test_guarded_leaves_the_no_op_and_guarded_observers_as_they_are() -> None:
    assert guarded(NULL_OBSERVER) is NULL_OBSERVER
    once = guarded(Broken())
    assert isinstance(once, Guarded) and guarded(once) is once


def test_one_raising_observer_of_several_does_not_keep_the_others_from_their_calls() -> None:
    class Counting(Observer):
        batches = 0

        def batch(self, sink: str, **_: Any) -> None:
            self.batches += 1

    counting = Counting()
    both = guarded(Observers(Broken(), counting))
    both.batch("s", size=1, delivered=1, retried=0, dead=0, latencies=[])
    assert counting.batches == 1


class Scoped(Observer):
    """A delivering scope that fails where it is told to, and records what it was told."""

    def __init__(self, fail: str) -> None:
        self.fail = fail
        self.seen: list[Any] = []

    @contextlib.contextmanager
    def delivering(self, sink: Any, events: Sequence[Any]) -> Iterator[Delivery]:
        if self.fail == "enter":
            raise RuntimeError("enter is broken")
        observed = self

        class Told(Delivery):
            def landed(self, checkpoint: Any, buckets: set[int]) -> None:
                observed.seen.append(("landed", buckets))
                if observed.fail == "landed":
                    raise RuntimeError("landed is broken")

        try:
            yield Told()
        except Exception as exc:
            self.seen.append(("raised", exc))
            if self.fail == "swallow":
                return  # a scope that would swallow the batch's exception
            raise RuntimeError("exit is broken") from exc
        if self.fail == "exit":
            raise RuntimeError("exit is broken")


@pytest.mark.parametrize("fail", ["enter", "landed", "exit"])
def test_a_delivering_scope_that_raises_does_not_fail_the_batch(fail: str, caplog: pytest.LogCaptureFixture) -> None:
    o = guarded(Scoped(fail))
    with caplog.at_level(logging.ERROR, logger="outbox_relay.observer"), \
            o.delivering(object(), []) as delivery:  # type: ignore[arg-type]
        delivery.landed(None, {1})
    assert len(errors(caplog)) == 1


@pytest.mark.parametrize("fail", ["exit", "swallow"])
def test_a_batch_s_exception_goes_through_the_scope_unchanged(fail: str) -> None:
    scoped = Scoped(fail)
    o = guarded(scoped)
    failure = ValueError("the sink failed")
    with pytest.raises(ValueError) as raised, o.delivering(object(), []):  # type: ignore[arg-type]
        raise failure
    assert raised.value is failure
    assert scoped.seen == [("raised", failure)], "the scope is told"
