"""The pure core of the relay loop, without a database: classify (outcomes -> checkpoint), the per-key
rule, read limits, notification hints and the delivery gate."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime

import pytest

from outbox_relay.backoff import Backoff
from outbox_relay.relay import MIN_BUCKET_LIMIT, DeliveryGate, Hints, classify, read_limits
from outbox_relay.sinks.engine import Aborted, Failure, KeyHold
from outbox_relay.store import StoredEvent

NOW = datetime(2026, 11, 23, tzinfo=UTC)
BACKOFF = Backoff(1.0, 1.0)


def event(key: str, seq: int, *, bucket: int = 1, attempts: int = 0, parked: bool = False,
          blocked: bool = False) -> StoredEvent:
    return StoredEvent(bucket, 100, seq, uuid.uuid4(), key, "t", "type", "{}", "{}", NOW, attempts=attempts,
                       blocked=blocked, parked=parked)


def test_delivered_events_count_and_a_parked_one_leaves_the_park() -> None:
    a, b = event("a", 1), event("b", 2, parked=True, attempts=2)
    cp = classify([a, b], {a.id: None, b.id: None}, {1: 7}, max_attempts=5, backoff=BACKOFF)
    assert cp.delivered == [a, b] and cp.done == [b] and cp.park == [] and cp.dead == []


def test_a_retriable_failure_parks_its_key_and_everything_behind_it_waits() -> None:
    head, behind, other = event("k", 1), event("k", 2), event("o", 3)
    cp = classify([head, behind, other], {head.id: Failure("boom"), other.id: None}, {1: 1},
                  max_attempts=5, backoff=BACKOFF)
    assert [(e, n, err) for e, n, _, err in cp.park] == [(head, 1, "boom"), (behind, 0, None)]
    assert cp.delivered == [other]


def test_past_max_attempts_or_non_retriable_goes_to_dead_letters_and_the_key_moves_on() -> None:
    tired, fresh, poison, after = event("k", 1, attempts=4, parked=True), event("k", 2), event("p", 3), event("p", 4)
    cp = classify([tired, fresh, poison, after],
                  {tired.id: Failure("again"), fresh.id: None, poison.id: Failure("too big", retriable=False),
                   after.id: None}, {1: 1}, max_attempts=5, backoff=BACKOFF)
    assert [(e, n) for e, n, _ in cp.dead] == [(tired, 5), (poison, 1)]
    assert cp.done == [tired] and cp.delivered == [fresh, after] and cp.park == []


def test_an_event_not_attempted_or_blocked_queues_behind_without_an_attempt() -> None:
    blocked, unattempted = event("b", 1, blocked=True), event("u", 2)
    cp = classify([blocked, unattempted], {}, {1: 1}, max_attempts=5, backoff=BACKOFF)
    assert [(e, n, err) for e, n, _, err in cp.park] == [(blocked, 0, None), (unattempted, 0, None)]


def test_key_hold_is_the_rule_every_sink_follows() -> None:
    hold = KeyHold()
    a1, a2, b1 = event("a", 1), event("a", 2), event("b", 3)
    hold.record(a1, Failure("retry me"))
    hold.record(b1, Failure("never", retriable=False))
    assert not hold.allows(a2), "after a retriable failure the key waits"
    assert hold.allows(b1), "a dead letter lets its key move on"


def test_read_limits_share_the_batch_rotate_and_feed_busy_buckets() -> None:
    limits = read_limits(range(4), set(), 1000, 0)
    assert list(limits) == [0, 1, 2, 3] and set(limits.values()) == {250}
    assert list(read_limits(range(4), set(), 1000, 1)) == [1, 2, 3, 0], "the order rotates"
    many = read_limits(range(256), set(), 1000, 0)
    assert set(many.values()) == {MIN_BUCKET_LIMIT}, "never fewer than MIN_BUCKET_LIMIT"
    busy = read_limits(range(256), {5}, 1000, 0)
    assert busy[5] == 1000 and busy[6] == MIN_BUCKET_LIMIT, "a bucket whose last read was full gets the budget"
    assert read_limits([], {1}, 1000, 3) == {}


def test_hints_say_everything_first_then_what_notifications_named() -> None:
    hints = Hints()
    assert hints.take() is None, "read everything at start"
    hints.add([3, 4])
    hints.add([4, 9])
    assert hints.take() == {3, 4, 9}
    assert hints.take() == set()
    hints.add([1])
    hints.everything()
    assert hints.take() is None


def test_an_exclusive_probe_waits_for_shared_batches_and_holds_new_ones_back() -> None:
    gate, abort = DeliveryGate(), threading.Event()
    order: list[str] = []
    shared_in = threading.Event()
    release_shared = threading.Event()

    def batch() -> None:
        with gate.shared(abort):
            shared_in.set()
            release_shared.wait(5)
            order.append("batch ends")

    def probe() -> None:
        with gate.exclusive(abort):
            order.append("probe runs")

    t1 = threading.Thread(target=batch)
    t1.start()
    assert shared_in.wait(5)
    t2 = threading.Thread(target=probe)
    t2.start()
    time.sleep(0.2)
    assert order == [], "the probe waits for the batch in flight"
    release_shared.set()
    t1.join(5)
    t2.join(5)
    assert order == ["batch ends", "probe runs"]


def test_a_hard_stop_ends_a_wait_at_the_gate() -> None:
    gate, abort = DeliveryGate(), threading.Event()
    with gate.shared(abort):
        abort.set()
        with pytest.raises(Aborted), gate.exclusive(abort):
            pass


def test_a_stuck_batch_holds_the_gate_for_no_longer_than_its_stale_time() -> None:
    """Issue 15: one stuck sink never stops another. A batch in the gate for longer than the stale time
    (a sink that never returns) no longer keeps a probe out, nor the batches a waiting probe holds back."""
    gate, abort = DeliveryGate(stale_seconds=0.3), threading.Event()
    stuck_in, release = threading.Event(), threading.Event()

    def stuck() -> None:
        with gate.shared(abort):
            stuck_in.set()
            release.wait(30)

    t = threading.Thread(target=stuck, daemon=True)
    t.start()
    assert stuck_in.wait(5)
    probed = threading.Event()

    def probe() -> None:
        with gate.exclusive(abort):
            probed.set()

    p = threading.Thread(target=probe, daemon=True)
    p.start()
    with gate.shared(abort):  # another sink's batch gets in while the probe waits or once it ran
        pass
    assert probed.wait(10), "the probe ran although a stuck batch was still in"
    release.set()
    t.join(5)
    p.join(5)
