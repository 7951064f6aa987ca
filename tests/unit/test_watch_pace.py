"""The commit watcher's pace (wakeups.WatchPace): it backs off while nothing commits and comes back
at the first commit."""

from __future__ import annotations

from outbox_relay.wakeups import BUSY_GAP_MAX_MS, WatchPace


def test_each_call_without_a_commit_doubles_the_interval_up_to_the_longest() -> None:
    pace = WatchPace(shortest_ms=1, longest_ms=8)
    assert pace.interval_ms == 1
    assert [pace.after(found=False) for _ in range(5)] == [2, 4, 8, 8, 8]


def test_the_first_commit_brings_the_shortest_interval_back_at_once() -> None:
    pace = WatchPace(shortest_ms=1, longest_ms=8)
    for _ in range(10):
        pace.after(found=False)
    assert pace.after(found=True) == 1
    assert pace.after(found=True) == 1, "commits that keep coming keep the shortest interval"
    assert pace.after(found=False) == 2


def test_a_longest_below_the_shortest_is_read_as_the_shortest_and_reset_starts_over() -> None:
    fixed = WatchPace(shortest_ms=5, longest_ms=1)
    assert [fixed.after(found=False) for _ in range(3)] == [5, 5, 5]
    pace = WatchPace(shortest_ms=3, longest_ms=100)
    pace.after(found=False)
    pace.reset()
    assert pace.interval_ms == 3


def test_commits_found_at_every_first_look_space_the_calls_and_a_call_that_waited_ends_that() -> None:
    """Under load every call returns at its first look: the calls are spaced (up to BUSY_GAP_MAX_MS) so
    that each gathers a few milliseconds of commits instead of one; a call that waited means commits are
    sparser than the looks again."""
    pace = WatchPace(shortest_ms=1, longest_ms=8)
    assert pace.gap_ms == 0
    assert [(pace.after(found=True, at_once=True), pace.gap_ms) for _ in range(4)] == [
        (1, 1), (1, 2), (1, BUSY_GAP_MAX_MS), (1, BUSY_GAP_MAX_MS)]
    pace.after(found=True, at_once=False)
    assert pace.gap_ms == 0, "found after waiting: no gap"
    pace.after(found=True, at_once=True)
    pace.after(found=False)
    assert pace.gap_ms == 0, "nothing found: no gap"
    pace.after(found=True, at_once=True)
    pace.reset()
    assert pace.gap_ms == 0
