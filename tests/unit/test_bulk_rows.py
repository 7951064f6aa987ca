"""The bulk phase builds the handler's events straight from its rows (projections/bulk.py handed_over):
the same events ``Projection.prepare`` makes from the StoredEvents of those rows, and for any row
prepare would not hand over plainly, nothing (the slice then takes prepare's path, which decides)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel

from outbox_relay.store import event_reader
from projections import ProjectionEvent, Upcasters, projection
from projections.bulk import FENCES, READ_COLUMNS, handed_over
from projections.declare import Projection

TIME = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)


class _Column:
    def __init__(self, name: str) -> None:
        self.name = name


class _Cursor:
    description = tuple(_Column(n) for n in READ_COLUMNS)


def row(i: int, type_: str = "Paid", payload: str = '{"cents": 5}', headers: str = "{}", version: int = 1,
        topic: str | None = "orders") -> tuple[Any, ...]:
    return (i % 256, 1000 + i // 3, i, uuid.UUID(int=i + 1), f"k{i % 7}", topic, type_, payload, headers,
            TIME, version)


class Cents(BaseModel):
    cents: int


def upcasters() -> Upcasters:
    ups = Upcasters()

    @ups.register("Paid", version=1)
    def euros(p: dict[str, Any]) -> dict[str, Any]:
        if "euros" not in p:
            raise KeyError("euros")
        return {"cents": p["euros"] * 100}

    return ups


def declared(**kw: Any) -> Projection:
    @projection("p", tables=["t"], **kw)
    def apply(event: ProjectionEvent[Any], tx: Any) -> None:
        pass

    return apply


def prepared(p: Projection, rows: list[tuple[Any, ...]]) -> list[Any]:
    read, _ = event_reader(_Cursor())  # type: ignore[arg-type]
    stored = [read(r) for r in rows]
    return [p.prepare(e, FENCES[e.bucket], True) for e in stored]


PLAIN = [row(i) for i in range(20)] + [
    row(20, headers='{"trace": "abc", "b": "x"}'), row(21, topic=None), row(22, payload='[1, {"a": null}]'),
    row(23, payload='"text"'), row(24, version=3), row(25, type_="Other", payload='{"x": 1.5}')]


@pytest.mark.parametrize("kw", [{}, {"events": ["Paid", "Other"]}], ids=["every type", "declared types"])
def test_plain_rows_give_the_events_prepare_gives(kw: dict[str, Any]) -> None:
    p = declared(**kw)
    got = handed_over(p, PLAIN)
    assert got is not None and got == prepared(p, PLAIN)
    assert [e.token for e in got] == [e.token for e in prepared(p, PLAIN)]  # (0, 0, xid, seq)
    assert all(e.replay and e.attempt == 1 for e in got)


def test_upcasters_and_models_give_what_prepare_gives() -> None:
    rows = [row(i, payload=f'{{"euros": {i}}}') for i in range(5)] + [row(5, payload='{"cents": 7}', version=2)]
    p = declared(events={"Paid": Cents}, upcasters=upcasters())
    got = handed_over(p, rows)
    assert got is not None and got == prepared(p, rows)
    assert [e.payload for e in got] == [Cents(cents=i * 100) for i in range(5)] + [Cents(cents=7)]
    assert {e.version for e in got} == {2}


@pytest.mark.parametrize(("kw", "odd"), [
    ({"events": ["Paid"], "on_unknown": "reject"}, row(3, type_="Other")),
    ({}, row(3, payload='{"cents": ')),
    ({}, row(3, headers='{"n": 1}')),
    ({}, row(3, headers="[]")),
    ({"upcasters": upcasters()}, row(3, payload='{"cents": 1}')),  # the upcaster raises
    ({"events": {"Paid": Cents}}, row(3, payload='{"cents": "many"}')),
], ids=["unknown type rejected", "payload", "header value", "headers not an object", "upcaster", "model"])
def test_a_row_prepare_would_not_hand_over_leaves_the_slice_to_prepare(kw: dict[str, Any], odd: tuple[Any, ...]
                                                                       ) -> None:
    p = declared(**kw)
    rows = [row(1), row(2), odd, row(4)]
    assert handed_over(p, rows) is None
    assert not isinstance(prepared(p, rows)[2], ProjectionEvent)  # prepare decides: a failure
