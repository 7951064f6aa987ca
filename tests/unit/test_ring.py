"""The consistent-hash ring over the 256 buckets (G8's arithmetic half; no database)."""

from __future__ import annotations

import statistics

import pytest

from outbox_relay.ring import BUCKETS, Ring

NAME_SETS = [
    ["w0", "w1", "w2", "w3", "w4"],
    ["worker-1", "worker-2", "worker-3", "worker-4", "worker-5"],
    ["relay-a.prod-1234", "relay-b.prod-2345", "relay-c.prod-3456", "relay-d.prod-4567", "relay-e.prod-5678"],
    ["ip-10-0-0-1-811", "ip-10-0-0-2-812", "ip-10-0-0-3-813", "ip-10-0-0-4-814", "ip-10-0-0-5-815"],
]


def moved(before: Ring, after: Ring) -> dict[int, tuple[str | None, str | None]]:
    a, b = before.assignment(), after.assignment()
    return {bucket: (a[bucket], b[bucket]) for bucket in range(BUCKETS) if a[bucket] != b[bucket]}


def test_buckets_match_the_schema() -> None:
    assert BUCKETS == 256  # outbox.bucket_v1 masks with 255 and cursors CHECK bucket < 256


def test_deterministic_whatever_the_order_or_instance() -> None:
    names = NAME_SETS[1]
    a = Ring(names).assignment()
    assert Ring(list(reversed(names))).assignment() == a
    assert Ring([*names, names[0]]).assignment() == a  # duplicates collapse
    # Pinned: every relay process (any interpreter, any version) must compute the same owners from the
    # same live set, or two workers would claim one bucket during a rolling deploy.
    assert [Ring(["a", "b", "c", "d"]).owner(b) for b in range(12)] == [
        "c", "c", "a", "c", "a", "d", "a", "b", "d", "b", "a", "d"]


@pytest.mark.parametrize("live", [1, 2, 3, 4, 5])
def test_every_bucket_has_exactly_one_live_owner(live: int) -> None:
    ring = Ring(NAME_SETS[0][:live])
    owners = ring.assignment()
    assert set(owners) == set(range(BUCKETS))
    assert set(owners.values()) <= set(ring.workers)
    # buckets_of partitions the buckets: disjoint and complete.
    parts = [ring.buckets_of(w) for w in ring.workers]
    assert sum(len(p) for p in parts) == BUCKETS
    assert set().union(*parts) == set(range(BUCKETS))


def test_empty_ring_owns_nothing() -> None:
    assert Ring([]).owner(0) is None
    assert set(Ring([]).assignment().values()) == {None}


@pytest.mark.parametrize("names", NAME_SETS, ids=lambda n: n[0])
def test_fair_share_with_four_workers(names: list[str]) -> None:
    ring = Ring(names[:4])
    shares = [len(ring.buckets_of(w)) / BUCKETS for w in ring.workers]
    assert all(0.10 <= s <= 0.40 for s in shares), shares


@pytest.mark.parametrize("names", NAME_SETS, ids=lambda n: n[0])
def test_adding_a_fifth_worker_moves_about_a_fifth_and_only_to_it(names: list[str]) -> None:
    before, after = Ring(names[:4]), Ring(names)
    changes = moved(before, after)
    assert 0.10 <= len(changes) / BUCKETS <= 0.30, len(changes)
    assert {to for _, to in changes.values()} == {names[4]}


def test_average_movement_is_one_over_n_plus_one() -> None:
    fractions = [len(moved(Ring([f"h{n}-{i}" for i in range(4)]), Ring([f"h{n}-{i}" for i in range(5)]))) / BUCKETS
                 for n in range(60)]
    assert 0.17 <= statistics.mean(fractions) <= 0.23


@pytest.mark.parametrize("names", NAME_SETS, ids=lambda n: n[0])
def test_removing_a_worker_moves_only_its_buckets(names: list[str]) -> None:
    before = Ring(names)
    for gone in names:
        after = Ring([n for n in names if n != gone])
        changes = moved(before, after)
        assert set(changes) == before.buckets_of(gone)
        assert all(frm == gone and to != gone for frm, to in changes.values())


def test_more_vnodes_spread_more_evenly() -> None:
    names = NAME_SETS[2][:4]

    def spread(vnodes: int) -> float:
        ring = Ring(names, vnodes=vnodes)
        return statistics.pstdev(len(ring.buckets_of(w)) for w in ring.workers)

    assert spread(256) < spread(1)
