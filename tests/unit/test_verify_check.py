"""The verify check without servers: each verdict (lost, reordered, phantom, duplicate, not yet delivered, not
checkable, overlapping transactions) from plain data."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from outbox_relay.verify.check import Check, Received, Report, Stored

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def ids(n: int) -> list[uuid.UUID]:
    return [uuid.UUID(int=i + 1) for i in range(n)]


def stored(i: uuid.UUID, key: str, xid: int, seq: int, state: str = "delivered", **times: datetime) -> Stored:
    return Stored(i, key, xid, seq, state, **times)


def run(history: list[Stored], got: list[tuple[uuid.UUID, str, str]] | None, *, removed: int = 0,
        later: tuple[uuid.UUID, ...] = ()) -> Report:
    check = Check(Report("s", "kafka", "", removed_by_retention=removed),
                  None if got is None else [Received(*g) for g in got], sample=3)
    check.add(history)
    return check.finish(later)


def test_everything_delivered_and_read_back_in_order_is_ok() -> None:
    a, b, c = ids(3)
    r = run([stored(a, "k", 10, 1), stored(b, "k", 10, 2), stored(c, "j", 11, 3)],
            [(a, "k", "t[0]"), (c, "j", "t[1]"), (b, "k", "t[0]")])
    assert r.ok and (r.stored, r.delivered, r.received, r.distinct, r.duplicates) == (3, 3, 3, 3, 0)


def test_a_delivered_event_not_read_back_is_lost_and_named_with_its_key() -> None:
    a, b, c = ids(3)
    r = run([stored(a, "k", 10, 1), stored(b, "k", 11, 1), stored(c, "k", 12, 1)], [(a, "k", "t[0]"), (c, "k", "t[0]")])
    assert not r.ok and r.lost == 1
    assert [(k.key, k.event_ids, k.count) for k in r.lost_keys] == [("k", [b], 1)]


def test_pending_and_dead_lettered_events_are_not_lost() -> None:
    a, b, c = ids(3)
    r = run([stored(a, "k", 10, 1, "dead"), stored(b, "k", 11, 1, "pending"), stored(c, "k", 12, 1, "dead")],
            [(c, "k", "t[0]")])
    assert r.ok and (r.pending, r.dead_lettered, r.dead_read_back, r.lost) == (1, 2, 1, 0)


def test_an_id_never_stored_is_a_phantom_unless_retention_removed_history_or_it_was_stored_since() -> None:
    a, ghost, late = ids(3)
    history = [stored(a, "k", 10, 1)]
    got = [(a, "k", "t[0]"), (ghost, "k", "t[0]"), (ghost, "k", "t[0]"), (late, "k", "t[0]")]
    r = run(history, got, later=(late,))
    assert not r.ok and r.phantoms == 1 and [p.id for p in r.phantom_events] == [ghost], "one event, two copies"
    assert r.pending == 1, "stored after the snapshot: not yet checkpointed, not a phantom"
    r = run(history, got, removed=100, later=(late,))
    assert r.ok and r.not_checkable == 1 and "retention removed 100" in r.notes[0]


def test_an_event_of_a_topic_the_sink_does_not_read_is_a_phantom_when_read_back() -> None:
    a, other = ids(2)
    r = run([stored(a, "k", 10, 1), stored(other, "k", 10, 2, "unrouted")], [(a, "k", "t[0]"), (other, "k", "t[0]")])
    assert r.phantoms == 1 and r.phantom_events[0].reason.startswith("stored, but of a topic")
    assert r.stored == 1


def test_two_events_of_a_key_swapped_in_one_destination_are_reordered() -> None:
    a, b, c = ids(3)
    history = [stored(a, "k", 10, 1), stored(b, "k", 11, 1), stored(c, "k", 12, 1)]
    r = run(history, [(b, "k", "t[0]"), (a, "k", "t[0]"), (c, "k", "t[0]")])
    assert not r.ok and r.reordered == 1
    (k,) = r.reordered_keys
    assert (k.key, k.destination, k.came_first, k.came_after) == ("k", "t[0]", b, a)
    # Across destinations there is no order to keep.
    assert run(history, [(b, "k", "t[0]"), (a, "k", "u[0]"), (c, "k", "t[0]")]).ok


def test_redelivery_duplicates_but_the_first_copies_decide_the_order() -> None:
    a, b, c = ids(3)
    history = [stored(a, "k", 10, 1), stored(b, "k", 11, 1), stored(c, "k", 12, 1)]
    r = run(history, [(a, "k", "t[0]"), (b, "k", "t[0]"), (a, "k", "t[0]"), (b, "k", "t[0]"), (c, "k", "t[0]")])
    assert r.ok and r.duplicates == 2 and r.distinct == 3


def test_inversions_of_overlapping_transactions_are_allowed_when_commit_times_tell() -> None:
    a, b = ids(2)
    # a's transaction (smaller id) committed after b's began: they overlapped, either order is right.
    overlapping = [stored(a, "k", 10, 1, started_at=T0, committed_at=T0 + timedelta(seconds=2)),
                   stored(b, "k", 11, 1, started_at=T0 + timedelta(seconds=1), committed_at=T0 + timedelta(seconds=1))]
    r = run(overlapping, [(b, "k", "t[0]"), (a, "k", "t[0]")])
    assert r.ok and r.overlapping == 1
    # a committed before b began: a must come first.
    apart = [stored(a, "k", 10, 1, started_at=T0, committed_at=T0 + timedelta(seconds=1)),
             stored(b, "k", 11, 1, started_at=T0 + timedelta(seconds=2), committed_at=T0 + timedelta(seconds=3))]
    assert run(apart, [(b, "k", "t[0]"), (a, "k", "t[0]")]).reordered == 1
    # Commit times unknown: counted.
    assert run([stored(a, "k", 10, 1), stored(b, "k", 11, 1)], [(b, "k", "t[0]"), (a, "k", "t[0]")]).reordered == 1
    # One transaction's events never overlap each other.
    same = [stored(a, "k", 10, 1, started_at=T0, committed_at=T0 + timedelta(seconds=9)),
            stored(b, "k", 10, 2, started_at=T0, committed_at=T0 + timedelta(seconds=9))]
    assert run(same, [(b, "k", "t[0]"), (a, "k", "t[0]")]).reordered == 1


def test_a_sink_that_can_not_be_read_back_loses_nothing_and_counts_its_records() -> None:
    a, b, c = ids(3)
    r = run([stored(a, "k", 10, 1), stored(b, "k", 11, 1, "pending"), stored(c, "k", 12, 1, "dead")], None)
    assert r.ok and (r.delivered, r.pending, r.dead_lettered, r.received) == (1, 1, 1, 0)


def test_the_report_names_at_most_sample_keys_but_counts_all() -> None:
    events = ids(10)
    r = run([stored(e, f"k{i}", 10 + i, 1) for i, e in enumerate(events)], [])
    assert r.lost == 10 and len(r.lost_keys) == 3
