"""The relay process's services without a database: waking runners by bucket, a service thread's stop."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, cast

from outbox_relay.relay import PARKED_NOTICE
from outbox_relay.services.thread import ServiceThread
from outbox_relay.services.wake import wake_owners


class FakeLeases:
    def __init__(self, held: set[int]) -> None:
        self.held = held

    def holds_any(self, buckets: list[int]) -> bool:
        return not self.held.isdisjoint(buckets)


class FakeHints:
    def __init__(self) -> None:
        self.added: list[int] = []
        self.all = False

    def add(self, buckets: list[int]) -> None:
        self.added += buckets

    def everything(self) -> None:
        self.all = True


def runner(held: set[int], desired: set[int] | None) -> Any:
    return SimpleNamespace(leases=FakeLeases(held), desired=desired, hints=FakeHints(),
                           wake=threading.Event(), park_changed=threading.Event())


def test_a_notification_wakes_only_the_runners_that_hold_or_want_its_buckets() -> None:
    holder, wanter, other = runner({1}, set()), runner(set(), {2}), runner({3}, {3})
    wake_owners(cast(Any, [holder, wanter, other]), "1,2")
    assert holder.wake.is_set() and wanter.wake.is_set() and not other.wake.is_set()
    assert holder.hints.added == [1, 2] and not holder.park_changed.is_set()


def test_an_operators_notice_has_the_owners_look_at_their_park_and_garbage_wakes_everyone() -> None:
    holder, other = runner({5}, None), runner(set(), None)
    wake_owners(cast(Any, [holder, other]), f"{PARKED_NOTICE}5")
    assert holder.park_changed.is_set() and not other.wake.is_set()
    wake_owners(cast(Any, [holder, other]), "not buckets")
    assert other.wake.is_set() and other.hints.all and other.park_changed.is_set()


def test_a_service_thread_ends_at_stop() -> None:
    class Ticking(ServiceThread):
        name = "ticking"

        def run(self) -> None:
            while not self.stopped.wait(0.01):
                pass

    service = Ticking()
    service.start()
    service.stop()
    service.join(5.0)
    assert not service.is_alive()
