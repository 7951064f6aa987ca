"""The checker must fail when it should: each check against a small, hand-made run (no servers)."""

from __future__ import annotations

import uuid

import pytest

from tests.faults.checker import Committed, DeadLetter, Fault, check
from tests.faults.recorder import Record

T0 = 1_000_000.0


def committed(key: str, n: int, at: float) -> Committed:
    return Committed(str(uuid.uuid5(uuid.NAMESPACE_URL, f"{key}:{n}")), key, 0, n, T0 + at)


def record(c: Committed, offset: int, at: float, *, incarnation: int = 0, partition: int = 0,
           n: int | None = None) -> Record:
    return Record(incarnation, partition, offset, c.event_id, c.key, 0, c.n if n is None else n, 1, T0 + at)


def in_order(events: list[Committed], latency: float = 0.05) -> list[Record]:
    return [record(c, i, c.created_at - T0 + latency) for i, c in enumerate(events)]


def test_a_clean_run_passes() -> None:
    events = [committed("a", n, n * 0.1) for n in range(1, 6)] + [committed("b", n, n * 0.1) for n in range(1, 4)]
    result = check(events, [], in_order(events), [])
    assert result.passed, result.problems()
    assert (result.committed, result.consumed, result.distinct, result.duplicate_rate) == (8, 8, 8, 1.0)


def test_an_event_never_consumed_is_lost_and_blamed_on_the_fault_that_owns_its_commit() -> None:
    events = [committed("a", n, float(n)) for n in range(1, 11)]
    fault = Fault(0, "broker_restart", "tansu", "", T0 + 5.5, T0 + 6.0)
    records = in_order([e for e in events if e.n != 7])
    result = check(events, [], records, [fault])
    assert not result.passed
    assert [(x.key, x.n, x.fault) for x in result.lost] == [("a", 7, 0)]
    assert result.faults[0].lost == 1
    assert "1 committed events never consumed" in result.problems()[0]


def test_a_dead_letter_is_not_lost_but_listed() -> None:
    events = [committed("a", n, float(n)) for n in range(1, 4)]
    dead = [DeadLetter(events[1].event_id, "kafka", 10, "kafka: MSG_SIZE_TOO_LARGE")]
    result = check(events, dead, in_order([events[0], events[2]]), [])
    assert result.passed
    assert [d.event_id for d in result.dead_lettered] == [events[1].event_id]


def test_a_message_that_was_never_committed_is_a_phantom() -> None:
    events = [committed("a", 1, 0.0)]
    ghost = committed("a", 2, 1.0)
    result = check(events, [], in_order([events[0], ghost]), [])
    assert [r.event_id for r in result.phantoms] == [ghost.event_id]
    assert not result.passed


def test_a_committed_id_with_another_payload_is_reported() -> None:
    events = [committed("a", 1, 0.0), committed("a", 2, 1.0)]
    records = [record(events[0], 0, 0.1), record(events[1], 1, 1.1, n=5)]
    result = check(events, [], records, [])
    assert len(result.mismatched) == 1 and not result.passed


def test_redelivery_that_duplicates_without_reordering_passes() -> None:
    # A batch sent again after a crash: 1 2 3 2 3 4. First occurrences 1 2 3 4: in order.
    a = [committed("a", n, n * 0.1) for n in range(1, 5)]
    sequence = [a[0], a[1], a[2], a[1], a[2], a[3]]
    records = [record(c, i, 1.0 + i * 0.01) for i, c in enumerate(sequence)]
    result = check(a, [], records, [])
    assert result.passed, result.problems()
    assert result.consumed == 6 and result.distinct == 4 and result.duplicate_rate == pytest.approx(1.5)


def test_first_occurrences_out_of_order_are_caught() -> None:
    a = [committed("a", n, n * 0.1) for n in range(1, 5)]
    records = [record(c, i, 1.0) for i, c in enumerate([a[0], a[2], a[1], a[3]])]
    result = check(a, [], records, [])
    assert [r.key for r in result.reordered] == ["a"]
    assert result.reordered[0].got[:3] == (1, 3, 2)
    assert not result.passed


def test_order_runs_across_topic_incarnations() -> None:
    # Before a broker restart 1 2 4 were consumed; after it, 3 arrives: 3 came after 4.
    a = [committed("a", n, n * 0.1) for n in range(1, 5)]
    records = [record(a[0], 0, 1.0), record(a[1], 1, 1.0), record(a[3], 2, 1.0),
               record(a[2], 0, 2.0, incarnation=1)]
    result = check(a, [], records, [])
    assert [r.key for r in result.reordered] == ["a"]


def test_offsets_not_arrival_decide_the_order() -> None:
    # The gap filler finds offset 1 after offset 2 arrived: the topic order is still 1 2 3.
    a = [committed("a", n, n * 0.1) for n in range(1, 4)]
    records = [record(a[0], 0, 1.0), record(a[2], 2, 1.1), record(a[1], 1, 1.5)]
    assert check(a, [], records, []).passed


def test_a_key_in_two_partitions_is_reported() -> None:
    a = [committed("a", n, n * 0.1) for n in range(1, 3)]
    records = [record(a[0], 0, 1.0, partition=0), record(a[1], 0, 1.0, partition=1)]
    result = check(a, [], records, [])
    assert list(result.split_keys) == ["a"] and not result.passed


def test_a_gap_in_committed_sequence_numbers_is_reported() -> None:
    events = [committed("a", 1, 0.0), committed("a", 3, 1.0)]
    result = check(events, [], in_order(events), [])
    assert result.sequence_gaps == {"a": [2]} and not result.passed


def test_recovery_is_the_time_until_the_last_late_event_arrived() -> None:
    # Fault at 10 s; events committed at 10.2 and 10.4 wait until 13.0; events after 13 flow.
    fault = Fault(0, "relay_kill", "r1-0", "", T0 + 10.0, T0 + 10.0)
    before = [committed("a", 1, 5.0)]
    stuck = [committed("b", 1, 10.2), committed("b", 2, 10.4)]
    after = [committed("b", 3, 14.0)]
    records = [*in_order(before), record(stuck[0], 0, 13.0, partition=1), record(stuck[1], 1, 13.0, partition=1),
               record(after[0], 2, 14.05, partition=1)]
    result = check(before + stuck + after, [], records, [fault])
    (fr,) = result.faults
    assert fr.recovery == pytest.approx(3.0)
    assert fr.late == 2
    assert result.kinds[0].recovery_median == pytest.approx(3.0)


def test_no_late_event_means_no_recovery_time() -> None:
    fault = Fault(0, "db_cut", "r0-0", "", T0 + 1.0, T0 + 1.0)
    events = [committed("a", n, n * 0.5) for n in range(1, 8)]
    result = check(events, [], in_order(events), [fault])
    assert result.faults[0].recovery == 0.0 and result.faults[0].late == 0


def test_duplicates_are_attributed_to_the_fault_whose_window_consumed_them() -> None:
    f0 = Fault(0, "relay_kill", "r0-0", "", T0 + 10.0, T0 + 10.0)
    f1 = Fault(1, "kafka_cut", "all", "", T0 + 20.0, T0 + 20.0)
    a = [committed("a", n, float(n)) for n in range(1, 4)]
    records = [record(a[0], 0, 1.1), record(a[1], 1, 2.1), record(a[2], 2, 3.1),
               record(a[1], 3, 12.0), record(a[2], 4, 12.0), record(a[2], 5, 21.0)]
    result = check(a, [], records, [f0, f1])
    assert [fr.duplicates for fr in result.faults] == [2, 1]
    assert result.baseline is not None and result.baseline.duplicates == 0


def test_a_fault_injected_before_recovery_is_left_out_of_the_medians() -> None:
    f0 = Fault(0, "broker_restart", "tansu", "", T0 + 10.0, T0 + 11.0)
    f1 = Fault(1, "kafka_cut", "all", "", T0 + 20.0, T0 + 20.0, healthy_before=False)
    events = [committed("a", 1, 21.0)]
    records = [record(events[0], 0, 40.0)]
    result = check(events, [], records, [f0, f1])
    kinds = {k.kind: k for k in result.kinds}
    assert kinds["kafka_cut"].recovery_median is None and kinds["kafka_cut"].overlapped == 1
    assert result.faults[1].recovery == pytest.approx(20.0)


def test_the_wait_after_a_fault_is_its_slowest_pending_event_and_a_quiet_wait_is_a_stall() -> None:
    # Key a: committed at 1 s, held by a fault 2-10 s, arrives at 14 s (4 s after the end). Key b: nothing
    # injected, committed at 20 s, arrives at 27 s: a stall of 7 s. Key c: on time.
    a, b, c = committed("a", 1, 1.0), committed("b", 1, 20.0), committed("c", 1, 3.0)
    fault = Fault(0, "relay_starve", "all relays", "", T0 + 2.0, T0 + 10.0)
    records = [record(c, 0, 3.05), record(a, 1, 14.0), record(b, 2, 27.0)]
    result = check([a, b, c], [], records, [fault], stall=5.0)
    assert result.faults[0].wait_after_end == pytest.approx(4.0)
    assert [(s.events, round(s.longest, 1), round(s.started - T0, 1)) for s in result.stalls] == [(1, 7.0, 20.0)]
    # A wait inside the fault, or shorter than the threshold after it, is no stall.
    assert check([a, c], [], records[:2], [fault], stall=5.0).stalls == []


def test_duplicates_percent_counts_the_extra_copies() -> None:
    events = [committed("a", n, float(n)) for n in range(1, 5)]
    records = [*in_order(events), record(events[3], 4, 5.0)]
    assert check(events, [], records, []).duplicates_percent == pytest.approx(25.0)
