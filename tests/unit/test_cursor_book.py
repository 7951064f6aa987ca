"""The cursor book alone (no database): which cursor writes may wait, which are due, and what a landed
checkpoint, a lost bucket or a server restart leave of the cursors held in memory."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from outbox_relay.positions import Cursor, Snapshot
from outbox_relay.runner import CursorBook
from outbox_relay.store import Acquired, Checkpoint, StoredEvent

FLUSH = 10.0


def cursor(xmax: int) -> Cursor:
    return Cursor(Snapshot(xmax, xmax))


def book_holding(*buckets: int, lapses: int = 0, at: float = 100.0) -> CursorBook:
    book = CursorBook(FLUSH, 60.0, now=at)
    book.acquired({b: Acquired(fence=1, lapses=lapses, cursor=cursor(1)) for b in buckets}, at)
    return book


def never_suspect(bucket: int) -> bool:
    return False


def moves(*buckets: int, to: int = 5, resets: set[int] | None = None) -> Checkpoint:
    return Checkpoint(fences={b: 1 for b in buckets}, advance={b: cursor(to) for b in buckets},
                      resets=resets or set())


def test_a_cursor_written_within_the_flush_interval_may_wait_and_one_written_longer_ago_may_not() -> None:
    book = book_holding(1, at=100.0)
    cp = moves(1)
    assert book.deferrable(cp, never_suspect, True, now=105.0) == {1}
    assert book.deferrable(cp, never_suspect, True, now=111.0) == set(), "due: written now"


def test_no_cursor_write_waits_for_a_suspect_a_lapsed_reset_a_hold_that_ended_or_a_checkpoint_that_parks() -> None:
    book = book_holding(1, 2, lapses=1, at=100.0)
    assert book.deferrable(moves(1, 2), lambda b: b == 1, True, now=101.0) == {2}
    assert book.deferrable(moves(2, resets={2}), never_suspect, True, now=101.0) == set()
    assert book.deferrable(moves(2), never_suspect, False, now=101.0) == set()
    parks = moves(2)
    parks.park.append((StoredEvent(bucket=2, xid=3, seq=1, id=uuid.uuid4(), key="k", topic=None, type="t",
                                   payload_text="{}", headers_text="{}", time=datetime.now(UTC)), 1, 1.0, "no"))
    assert book.deferrable(parks, never_suspect, True, now=101.0) == set()
    assert not CursorBook(0.0, 60.0, now=0.0).deferrable(moves(2), never_suspect, True, now=1.0)


def test_a_deferred_landing_moves_the_read_cursor_and_owes_the_write_until_it_is_due() -> None:
    book = book_holding(1, at=100.0)
    cp = moves(1, to=7)
    cp.defer = {1}
    book.landed(cp, {1}, now=104.0)
    assert book.read_cursor(1) == cursor(7) and book.cursors[1] == cursor(1)
    assert book.owed == {1}
    assert book.until_owed_flush(True, now=104.0) == 6.0, "owed since the row was last written, at 100"
    assert book.owed_due({1: 1}, True, now=105.0) == {}
    assert book.owed_due({1: 1}, True, now=110.0) == {1: cursor(7)}
    assert book.owed_due({1: 1}, False, now=105.0) == {1: cursor(7)}, "a hold that ended makes them due"
    book.landed(moves(1, to=8), {1}, now=110.0)  # written
    assert book.owed == set() and book.cursors[1] == cursor(8) and not book.ahead


def test_a_landing_that_was_fenced_out_moves_nothing() -> None:
    book = book_holding(1, at=100.0)
    book.landed(moves(1, to=7), set(), now=101.0)
    assert book.read_cursor(1) == cursor(1)


def test_a_server_restart_drops_what_is_held_only_in_memory_and_a_lost_bucket_is_forgotten() -> None:
    book = book_holding(1, 2, at=100.0)
    book.passed_empty(1, cursor(9), cursor(1))
    cp = moves(2, to=7)
    cp.defer = {2}
    book.landed(cp, {2}, now=101.0)
    assert book.drop_unwritten() == 2
    assert book.read_cursor(1) == cursor(1) and book.read_cursor(2) == cursor(1) and not book.owed
    book.forget({2: 1})
    assert set(book.cursors) == {2}


def test_reads_are_numbered_per_bucket_from_one_under_each_new_fence() -> None:
    book = book_holding(1, at=0.0)

    def read(fence: int) -> int:
        e = StoredEvent(bucket=1, xid=3, seq=1, id=uuid.uuid4(), key="k", topic=None, type="t",
                        payload_text="{}", headers_text="{}", time=datetime.now(UTC))
        book.number_read([e], {1: fence})
        return e.read

    assert [read(1), read(1), read(2), read(2)] == [1, 2, 1, 2]


def test_while_nothing_holds_vacuum_back_a_busy_runner_writes_its_cursors_together_once_a_second() -> None:
    """Unheld, a write costs a statement and a commit, not a lasting dead row: a batch right after a write
    waits (folds), every owed cursor goes out in one write a second after the last, and a batch after a
    quiet second writes at once (sparse traffic keeps its cursors current)."""
    book = book_holding(1, 2, 3, at=100.0)
    assert book.deferrable(moves(1), never_suspect, False, now=100.5) == set(), "no write yet: written at once"
    assert not book.foldable(moves(1), never_suspect, False, now=100.5)
    book.landed(moves(1, to=6), {1}, now=100.5)
    assert book.wrote_at == 100.5
    assert book.deferrable(moves(2, 3), never_suspect, False, now=100.7) == {2, 3}
    assert book.foldable(moves(2, 3), never_suspect, False, now=100.7)
    assert book.deferrable(moves(2, 3), lambda b: b == 2, False, now=100.7) == {3}, "a suspect's write never waits"
    cp = moves(2, 3, to=7)
    cp.defer = {2, 3}
    book.landed(cp, {2, 3}, now=100.7)
    assert abs(book.until_owed_flush(False, now=100.7) - 0.8) < 1e-9, "a second after the runner's last write"
    assert not book.owed_due_now(True, False, now=101.4)
    assert book.owed_due_now(True, False, now=101.5), "no slack while busy: the cadence is the bound"
    assert book.owed_due({1: 1, 2: 1, 3: 1}, False, now=101.5) == {2: cursor(7), 3: cursor(7)}, "all owed, in one write"
    assert book.deferrable(moves(1), never_suspect, False, now=101.6) == set(), "a second since the last write"
    assert CursorBook(0.3, 60.0, now=0.0).busy_every() == 0.3, "never longer than cursor_flush_seconds"
