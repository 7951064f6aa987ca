"""The per-event decoding a rebuild does for every stored event: the faster paths give what the
plain ones give, errors included."""

from __future__ import annotations

import dataclasses
import json
import pickle
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from outbox_relay.store import StoredEvent, event_reader
from projections import FenceToken, ProjectionEvent
from projections.decoding import decode_json
from projections.event import make_event, make_token

TEXTS = ['{"a": 1, "b": [1, 2.5, null, true]}', '{"a":1}', ' {"a": 1}', '{"a": 1} ', '\n[1]\n', '[]', '"x"', "1",
         "-0.5e3", "null", "NaN", "Infinity", '{"a": "\\u00e9\\ud83d\\ude00"}', '{"a": 1}x', '{"a": 1} {}', "", " ",
         "{", "nul", '{"a": 01}', "[" * 100_000]


def outcome(decode: Any, text: str) -> tuple[str, Any]:
    try:
        return "value", decode(text)
    except (ValueError, RecursionError) as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("text", TEXTS, ids=lambda t: repr(t[:20]))
def test_decode_json_gives_what_json_loads_gives_values_and_errors(text: str) -> None:
    got, want = outcome(decode_json, text), outcome(json.loads, text)
    if got[0] == "value" and isinstance(want[1], float) and want[1] != want[1]:
        assert got[1] != got[1]  # NaN
    else:
        assert got == want


class _Column:
    def __init__(self, name: str) -> None:
        self.name = name


class _Cursor:
    def __init__(self, names: list[str]) -> None:
        self.description = [_Column(n) for n in names]


ID = uuid.uuid4()
TIME = datetime(2026, 11, 26, tzinfo=UTC)
READ = ["bucket", "xid", "seq", "id", "partition_key", "topic", "type", "payload", "headers", "time", "blocked",
        "id_text", "time_text", "sequence_text", "now", "stored_at", "version"]
READ_ROW = (7, 100, 2, ID, "k", None, "t.x", '{"a": 1}', "{}", TIME, True, None, None, None, "1:1:", TIME, 3)


@pytest.mark.parametrize(("names", "row", "extra", "want"), [
    (READ, READ_ROW, {}, StoredEvent(7, 100, 2, ID, "k", None, "t.x", '{"a": 1}', "{}", TIME, blocked=True,
                                     stored_at=TIME, version=3)),
    (READ, READ_ROW, {"parked": True, "read": 4},
     StoredEvent(7, 100, 2, ID, "k", None, "t.x", '{"a": 1}', "{}", TIME, blocked=True, stored_at=TIME, version=3,
                 parked=True, read=4)),
    # Columns in another order, and extra ones: by name.
    (["payload", "seq", "xid", "bucket", "id", "type", "topic", "partition_key", "time", "headers", "attempts", "x"],
     ('{"b": 2}', 5, 9, 1, ID, "t.y", "top", "key", TIME, '{"h": "v"}', 2, "ignored"), {},
     StoredEvent(1, 9, 5, ID, "key", "top", "t.y", '{"b": 2}', '{"h": "v"}', TIME, attempts=2)),
])
def test_event_reader_builds_the_event_by_column_name(names: list[str], row: tuple[Any, ...], extra: dict[str, Any],
                                                      want: StoredEvent) -> None:
    read, column = event_reader(_Cursor(names))  # type: ignore[arg-type]
    assert read(row, **extra) == want
    assert column == {n: i for i, n in enumerate(names)}


def test_make_token_and_make_event_give_what_the_constructors_give() -> None:
    token = make_token(3, 2, 100, 7)
    assert token == FenceToken(3, 2, 100, 7) and hash(token) == hash(FenceToken(3, 2, 100, 7))
    assert FenceToken(3, 2, 100, 6) < token < FenceToken(3, 3, 0, 0) and str(token) == str(FenceToken(3, 2, 100, 7))
    fields = {"id": ID, "type": "t.x", "key": "k", "topic": None, "payload": {"a": 1}, "headers": {"h": "v"},
              "time": TIME, "position": (100, 7), "token": token, "attempt": 2, "replay": True, "version": 3}
    # Every field of the dataclass, so that a field added later is not left unset by the fast path.
    assert list(fields) == [f.name for f in dataclasses.fields(ProjectionEvent)]
    fast, plain = make_event(**fields), ProjectionEvent(**fields)
    assert fast == plain and repr(fast) == repr(plain) and vars(fast) == vars(plain)
    assert fast.fence == 3 and pickle.loads(pickle.dumps(fast)) == plain
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.key = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        token.fence = 4  # type: ignore[misc]


def test_event_reader_names_a_required_field_no_column_gives() -> None:
    read, _ = event_reader(_Cursor(["bucket", "xid", "seq", "id", "partition_key", "topic", "type", "payload",
                                    "headers"]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="time"):
        read((1, 2, 3, ID, "k", None, "t", "{}", "{}"))


def test_event_reader_takes_rows_that_are_not_tuples() -> None:
    read, _ = event_reader(_Cursor(READ))  # type: ignore[arg-type]
    assert read(list(READ_ROW)) == read(READ_ROW)


def test_prepare_builds_what_the_constructors_build() -> None:
    from projections import projection

    @projection("p", events=["t.x"])
    def p(event: Any, tx: Any) -> None:
        pass

    stored = StoredEvent(7, 100, 2, ID, "k", "top", "t.x", '{"a": [1, 2]}', '{"h": "v"}', TIME, attempts=2, read=5,
                         version=1)
    got = p.prepare(stored, 9, True)
    want = ProjectionEvent(id=ID, type="t.x", key="k", topic="top", payload={"a": [1, 2]}, headers={"h": "v"},
                           time=TIME, position=(100, 2), token=FenceToken(9, 5, 100, 2), attempt=3, replay=True,
                           version=1)
    assert got == want and repr(got) == repr(want) and vars(got) == vars(want)
    assert isinstance(got, ProjectionEvent) and got.fence == 9 and pickle.loads(pickle.dumps(got)) == want
    assert vars(got.token) == vars(want.token) and hash(got.token) == hash(want.token)
    no_headers = p.prepare(dataclasses.replace(stored, headers_text="{}"), 9, False)
    assert isinstance(no_headers, ProjectionEvent) and no_headers.headers == {} and no_headers.replay is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.key = "other"  # type: ignore[misc]
