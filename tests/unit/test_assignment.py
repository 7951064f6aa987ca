"""The stored assignment of buckets to relays (G8's arithmetic half; no database): balanced within one
bucket, built deterministically, and moving the ideal share when a relay joins or leaves."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from outbox_relay.assignment import BUCKETS, buckets_of, rebalance

SIZES = [1, 2, 3, 4, 5, 8, 16, 32, 33, 64, 100, 128, 200, 255, 256]


def names(n: int, prefix: str = "relay") -> list[str]:
    return [f"{prefix}-{i}.prod-{1000 + i}" for i in range(n)]


def test_buckets_match_the_schema() -> None:
    assert BUCKETS == 256  # outbox.bucket_v1 masks with 255 and the cursors CHECK bucket < 256


@pytest.mark.parametrize("n", SIZES)
def test_every_member_holds_its_share_within_one_bucket(n: int) -> None:
    counts = Counter(rebalance([], names(n)))
    assert None not in counts and sum(counts.values()) == BUCKETS
    assert set(counts) == set(names(n)), "every member of up to 256 holds buckets"
    assert max(counts.values()) - min(counts.values()) <= 1
    if BUCKETS % n == 0:
        assert max(counts.values()) / (BUCKETS / n) == 1.0, "32 and 64 relays: max/mean 1.0 (goal <= 1.15)"


def test_deterministic_whatever_the_order_and_stable_when_nothing_changes() -> None:
    members = names(7)
    built = rebalance([], members)
    assert rebalance([], list(reversed(members))) == built
    assert rebalance([], [*members, members[0]]) == built, "duplicates collapse"
    assert rebalance(built, members) == built, "a balanced assignment of the same members stays as it is"
    assert buckets_of(built, members[0]) == {b for b, o in enumerate(built) if o == members[0]}
    # Pinned: a table built from nothing is the same in any interpreter (no dict or set order in it).
    assert rebalance([], ["a", "b", "c", "d"])[:12] == [
        "c", "c", "b", "b", "d", "a", "a", "a", "a", "b", "c", "c"]


def test_no_members_no_owners() -> None:
    assert rebalance(rebalance([], names(3)), []) == [None] * BUCKETS


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 31, 32, 63, 64, 100, 200, 255])
def test_a_joining_relay_takes_about_its_share_and_only_buckets_move_to_it(n: int) -> None:
    before = rebalance([], names(n))
    joiner = "relay-new"
    after = rebalance(before, [*names(n), joiner])
    moved = [b for b in range(BUCKETS) if before[b] != after[b]]
    assert {after[b] for b in moved} == {joiner}, "buckets move only to the new relay"
    assert len(moved) <= BUCKETS // (n + 1) + 1, f"{len(moved)} moved; the ideal is {BUCKETS / (n + 1):.1f}"
    assert Counter(after)[joiner] >= BUCKETS // (n + 1)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16, 32, 33, 64, 100, 256])
def test_a_leaving_relays_buckets_and_nothing_else_move(n: int) -> None:
    members = names(n)
    before = rebalance([], members)
    leaver = members[n // 2]
    after = rebalance(before, [m for m in members if m != leaver])
    moved = {b for b in range(BUCKETS) if before[b] != after[b]}
    assert moved == buckets_of(before, leaver), "only the leaver's buckets move"
    assert max(Counter(after).values()) - min(Counter(after).values()) <= 1


def test_a_random_history_of_joins_and_leaves_stays_balanced_and_moves_at_most_twice_the_ideal() -> None:
    rng = random.Random(8)
    members = names(10)
    owners = rebalance([], members)
    spare = iter(names(500, "later"))
    for _ in range(300):
        if len(members) > 1 and rng.random() < 0.5:
            members.remove(rng.choice(members))
            ideal = BUCKETS / (len(members) + 1)
        else:
            members.append(next(spare))
            ideal = BUCKETS / len(members)
        after = rebalance(owners, members)
        moved = sum(owners[b] != after[b] for b in range(BUCKETS))
        assert moved <= 2 * ideal + 1, (len(members), moved, ideal)
        counts = Counter(after)
        assert max(counts.values()) - min(counts.values()) <= 1 and set(counts) == set(members)
        owners = after
