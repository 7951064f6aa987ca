"""The read's partition floor (store.read_floor): never above the lowest xmin of the cursors it reads
for, whatever the range starts it was given (a stale or foreign list only prunes less)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from outbox_relay import store
from outbox_relay.positions import Cursor, Snapshot


class Catalog:
    """Stands in for a connection: answers the range_starts query with ``starts`` and counts the calls."""

    def __init__(self, starts: list[str | None], dbname: str = "db") -> None:
        self.starts = starts
        self.calls = 0
        self.info = SimpleNamespace(host="/tmp", port=5432, dbname=dbname)

    def execute(self, _query: str, *_args: Any) -> list[tuple[str | None]]:
        self.calls += 1
        return [(s,) for s in self.starts]


def reads(*xmins: int) -> dict[int, tuple[int, Cursor]]:
    return {b: (10, Cursor(Snapshot(x, x + 5))) for b, x in enumerate(xmins)}


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "_range_starts", {})


def test_the_floor_is_the_start_of_the_range_holding_the_lowest_xmin() -> None:
    conn: Any = Catalog([None, "100", "2000", "30000"])  # None: the DEFAULT range partition
    assert store.read_floor(conn, reads(2500, 40000)) == 2000
    assert store.read_floor(conn, reads(30000)) == 30000
    assert store.read_floor(conn, reads(99)) == 0, "below every range: no floor"
    assert store.read_floor(conn, {}) == 0
    assert conn.calls == 1, "the starts are read once per RANGE_STARTS_SECONDS"


@pytest.mark.parametrize("xmin", [1, 150, 2001, 29999, 10**9])
def test_a_stale_or_foreign_list_never_gives_a_floor_above_the_cursors(xmin: int) -> None:
    conn: Any = Catalog(["100", "2000", "30000"], dbname=f"other-{xmin}")
    assert store.read_floor(conn, reads(xmin, xmin + 7)) <= xmin


def test_the_starts_are_read_again_after_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    conn: Any = Catalog(["100"])
    assert store.read_floor(conn, reads(5000)) == 100
    conn.starts = ["100", "4000"]  # a range made since
    assert store.read_floor(conn, reads(5000)) == 100, "cached: a lower floor, still correct"
    monkeypatch.setattr(store, "RANGE_STARTS_SECONDS", 0.0)
    assert store.read_floor(conn, reads(5000)) == 4000
