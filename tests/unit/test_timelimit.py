"""The one time limit (outbox_relay/timelimit.py): a call that never returns is given up on at its
deadline, the owner decides under the call's lock whether it may still commit, and abandoned threads are
counted once per process, whichever owner left them."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from outbox_relay import timelimit
from outbox_relay.inbox import make_message
from outbox_relay.inbox.store import InboxStuck, TimeLimit
from outbox_relay.timelimit import Call, Deadline, HandlerThread
from tests.servers import wait_until


class _Conn:
    closed = False

    def cancel_safe(self, timeout: float) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_a_call_that_never_returns_is_given_up_on_at_its_deadline_and_its_thread_counted() -> None:
    release = threading.Event()
    deadline = Deadline("test-handler", 0.3)
    before = timelimit.abandoned_threads()
    call: Call[bool] = Call(release.wait)
    started = time.monotonic()
    deadline.start(call)
    assert deadline.wait(call) == "overdue"
    assert 0.3 <= time.monotonic() - started < 2.0
    assert call.abandon() and not call.begin_commit(), "an abandoned call may not commit"
    deadline.give_up()
    assert timelimit.abandoned_threads() == before + 1
    # The next call gets a new thread; the abandoned one ends when its handler returns.
    ok: Call[int] = Call(lambda: 7)
    deadline.start(ok)
    assert deadline.wait(ok) == "done" and ok.result() == 7
    release.set()
    wait_until(lambda: timelimit.abandoned_threads() == before, 10, 0.01, "the released thread ending")
    deadline.close()


def test_a_call_that_began_to_commit_is_not_abandoned_and_errors_reach_the_owner() -> None:
    call: Call[None] = Call(lambda: None)
    assert call.begin_commit() and not call.abandon()
    deadline = Deadline("test-handler", 5)
    def fails() -> None:
        raise KeyError("missing")

    failing: Call[None] = Call(fails)
    deadline.start(failing)
    assert deadline.wait(failing) == "done"
    with pytest.raises(KeyError, match="missing"):
        failing.result()
    stop = threading.Event()
    stop.set()
    blocked: Call[bool] = Call(threading.Event().wait)
    deadline.start(blocked)
    assert deadline.wait(blocked, stop) == "stop"
    assert blocked.abandon()
    deadline.give_up()


def test_the_inbox_stops_at_the_processs_cap_whoever_left_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread another owner (a relay sink's lane) abandoned counts against the inbox's cap too."""
    release = threading.Event()
    monkeypatch.setattr(timelimit, "MAX_ABANDONED", timelimit.abandoned_threads())
    limit = TimeLimit(5)
    limit.call(lambda m, c: None, make_message(), _Conn())  # type: ignore[arg-type]  # within the cap
    lane = HandlerThread("sink-other-1")
    lane.submit(Call(release.wait))
    assert lane.abandon(), "the process is over its cap now"
    seen: list[Any] = []
    try:
        with pytest.raises(InboxStuck, match="more than"):
            limit.call(lambda m, c: seen.append(m), make_message(), _Conn())  # type: ignore[arg-type]
        assert seen == [], "no handler starts over the cap"
    finally:
        release.set()
        limit.close()
