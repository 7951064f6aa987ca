"""The pure part of the read path (outbox_relay/positions.py): snapshots, cursors, what a read leaves."""

from __future__ import annotations

import random

import pytest

from outbox_relay.positions import ORIGIN, Cursor, Snapshot


def test_snapshot_text_round_trips_and_visibility_matches_postgres_rules() -> None:
    s = Snapshot.parse("10:20:12,15")
    assert (s.xmin, s.xmax, s.xip) == (10, 20, frozenset({12, 15}))
    assert str(s) == "10:20:12,15" and str(Snapshot.parse("7:7:")) == "7:7:"
    assert [x for x in range(5, 25) if s.visible(x)] == [5, 6, 7, 8, 9, 10, 11, 13, 14, 16, 17, 18, 19]


def test_origin_has_delivered_nothing() -> None:
    assert not any(Cursor(ORIGIN).delivered(x, 1) for x in range(3, 1000))


def test_a_read_that_returned_less_than_asked_moves_the_cursor_to_the_snapshot_it_read_in() -> None:
    seen, now = Snapshot(10, 20, frozenset({12})), Snapshot(15, 30, frozenset({25}))
    assert Cursor(seen).after_read(now, (20, 4), full=False) == Cursor(now)
    assert Cursor(seen).after_read(now, None, full=False) == Cursor(now), "an empty delta moves it too"


def test_a_full_read_pins_its_target_until_the_delta_is_done() -> None:
    seen, now, later = Snapshot(10, 20, frozenset({12})), Snapshot(15, 30), Snapshot(25, 40)
    paging = Cursor(seen).after_read(now, (22, 7), full=True)
    assert paging == Cursor(seen, now, (22, 7))
    assert paging.read_from(later) == now, "the next page comes from the same snapshot"
    assert paging.after_read(later, (24, 1), full=True) == Cursor(seen, now, (24, 1))
    assert paging.after_read(later, None, full=False) == Cursor(now), "done: the target becomes the cursor"


def test_delivered_while_paging_is_the_seen_snapshot_plus_the_targets_delta_up_to_after() -> None:
    paging = Cursor(Snapshot(10, 20, frozenset({12})), Snapshot(15, 30, frozenset({25})), (22, 7))
    assert paging.delivered(11, 99) and paging.delivered(19, 99), "visible in seen"
    assert paging.delivered(12, 1) and paging.delivered(22, 7), "in the target's delta, up to after"
    assert not paging.delivered(22, 8) and not paging.delivered(23, 1), "after it"
    assert not paging.delivered(25, 1), "still open at the target: next delta"
    assert not paging.delivered(30, 1)


def test_at_a_position_delivers_exactly_what_came_before_it() -> None:
    cursor = Cursor.at((100, 5))
    assert cursor.delivered(99, 10**6) and cursor.delivered(100, 4)
    assert not cursor.delivered(100, 5) and not cursor.delivered(101, 1)
    assert Cursor.at((0, 0)) == Cursor(ORIGIN)


def test_params_and_rows_round_trip() -> None:
    for cursor in (Cursor(ORIGIN), Cursor(Snapshot(10, 20, frozenset({12}))),
                   Cursor(Snapshot(10, 20), Snapshot(15, 30, frozenset({25, 27})), (22, 7))):
        assert Cursor.from_row(*cursor.params()) == cursor


@pytest.mark.parametrize("seed", range(20))
def test_reading_deltas_in_pages_delivers_each_committed_event_once_in_visibility_order(seed: int) -> None:
    """A simulated server: transactions start, write events, commit or abort at random; a reader with a
    random page size reads deltas the way fetch_events does. Every committed event is delivered exactly
    once, each transaction's events in order, and never before a transaction that became visible earlier."""
    rng = random.Random(seed)
    next_xid, seq = 3, 0
    open_: dict[int, list[int]] = {}  # xid -> seqs written so far
    committed: dict[int, list[int]] = {}
    became_visible: dict[int, int] = {}  # xid -> the read at which it was first visible
    cursor, delivered, reads = Cursor(ORIGIN), [], 0

    def snapshot() -> Snapshot:
        xip = frozenset(open_)
        return Snapshot(min(xip) if xip else next_xid, next_xid, xip)

    for _ in range(400):
        action = rng.random()
        if action < 0.3 or not open_:
            open_[next_xid] = []
            next_xid += 1
        elif action < 0.6:
            xid = rng.choice(list(open_))
            for _ in range(rng.randint(1, 4)):
                seq += 1
                open_[xid].append(seq)
        elif action < 0.75:
            xid = rng.choice(list(open_))
            events = open_.pop(xid)
            if rng.random() < 0.8:
                committed[xid] = events
        else:  # a read, as the relay makes it
            reads += 1
            now = snapshot()
            target = cursor.read_from(now)
            delta = sorted((x, s) for x, seqs in committed.items() for s in seqs
                           if target.visible(x) and not cursor.delivered(x, s))
            for x, _ in delta:
                became_visible.setdefault(x, reads)
            limit = rng.randint(1, 5)
            page = delta[:limit]
            delivered.extend(page)
            cursor = cursor.after_read(now, page[-1] if page else None, full=len(page) >= limit)
    while True:  # everything open ends; read until nothing is left
        for xid in list(open_):
            committed[xid] = open_.pop(xid)
        reads += 1
        now = snapshot()
        target = cursor.read_from(now)
        delta = sorted((x, s) for x, seqs in committed.items() for s in seqs
                       if target.visible(x) and not cursor.delivered(x, s))
        for x, _ in delta:
            became_visible.setdefault(x, reads)
        delivered.extend(delta[:3])
        cursor = cursor.after_read(now, delta[:3][-1] if delta[:3] else None, full=len(delta) >= 3)
        if not delta and cursor.target is None:
            break

    expected = sorted((x, s) for x, seqs in committed.items() for s in seqs)
    assert sorted(delivered) == expected and len(delivered) == len(set(delivered)), "each exactly once"
    order = [became_visible[x] for x, _ in delivered]
    assert order == sorted(order), "never before a transaction that became visible earlier"
    for x in committed:
        assert [s for y, s in delivered if y == x] == committed[x], "a transaction's events in order"
