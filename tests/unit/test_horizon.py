"""horizon.HorizonWatch: the vacuum horizon counts as held once the same transaction id stayed the
oldest for ``held_after`` seconds, and no longer as soon as it moves or none is left."""

from __future__ import annotations

from outbox_relay.horizon import HorizonWatch


def test_an_oldest_id_that_stays_is_held_after_a_while_and_released_when_it_moves() -> None:
    now = [0.0]
    watch = HorizonWatch(held_after=1.0, clock=lambda: now[0])
    assert not watch.observe("100") and not watch.held()
    now[0] = 0.5
    assert not watch.observe("100") and not watch.held(), "not yet a second"
    now[0] = 1.2
    assert watch.observe("100") and watch.held()
    now[0] = 1.4
    assert not watch.observe("100"), "no change"
    assert watch.observe("180") and not watch.held(), "it moved: the holder ended"
    now[0] = 3.0
    assert watch.observe("180") and watch.held()
    assert watch.observe(None) and not watch.held(), "nothing holds it"


def test_a_horizon_that_moves_at_every_heartbeat_is_never_held() -> None:
    now = [0.0]
    watch = HorizonWatch(held_after=1.0, clock=lambda: now[0])
    for i in range(20):
        now[0] = i * 0.5
        watch.observe(str(1000 + i))
        assert not watch.held()


def test_a_transaction_known_to_be_open_for_a_while_is_held_at_once() -> None:
    now = [10.0]
    watch = HorizonWatch(held_after=1.0, clock=lambda: now[0])
    assert not watch.observe("100", open_seconds=0.2), "open for less than held_after"
    assert watch.observe("100", open_seconds=1.5) and watch.held(), "no second heartbeat needed"
    assert watch.observe("200", open_seconds=0.0) and not watch.held(), "a new, young oldest"
