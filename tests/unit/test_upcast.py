"""Upcasters: a chain of steps per event type, and how an event that can not be brought up fails."""

from __future__ import annotations

from typing import Any

import pytest

from outbox_relay.errors import ConfigurationError
from outbox_relay.upcast import UpcastError, Upcasters


def chain() -> Upcasters:
    ups = Upcasters()

    @ups.register("OrderPlaced", version=1)
    def euros_to_cents(p: dict[str, Any]) -> dict[str, Any]:
        return {"customer": p["customer"], "cents": round(p["amount"] * 100)}

    @ups.register("OrderPlaced", version=2)
    def add_currency(p: dict[str, Any]) -> dict[str, Any]:
        return {**p, "currency": "EUR"}

    return ups


def test_a_payload_goes_through_every_step_to_the_current_version() -> None:
    ups = chain()
    assert ups.current("OrderPlaced") == 3 and ups.current("OrderPaid") == 1
    assert ups.upcast("OrderPlaced", 1, {"customer": "c", "amount": 1.25}) == (
        {"customer": "c", "cents": 125, "currency": "EUR"}, 3)
    assert ups.upcast("OrderPlaced", 2, {"customer": "c", "cents": 7}) == (
        {"customer": "c", "cents": 7, "currency": "EUR"}, 3)
    current = {"customer": "c", "cents": 7, "currency": "USD"}
    assert ups.upcast("OrderPlaced", 3, current) == (current, 3)
    assert ups.upcast("OrderPaid", 1, {"x": 1}) == ({"x": 1}, 1), "a type without steps stays as it is"


def test_a_version_the_code_does_not_know_waits_for_new_code() -> None:
    with pytest.raises(UpcastError, match="version 4, newer than this code knows") as newer:
        chain().upcast("OrderPlaced", 4, {})
    assert newer.value.retriable
    gap = Upcasters()
    gap.register("T", version=2)(lambda p: p)
    with pytest.raises(UpcastError, match="no upcaster turns 'T' version 1 into 2") as missing:
        gap.upcast("T", 1, {})
    assert missing.value.retriable


def test_a_step_that_raises_fails_the_event_for_good_naming_the_step() -> None:
    with pytest.raises(UpcastError, match=r"euros_to_cents .*'OrderPlaced' version 1 -> 2.*KeyError") as failed:
        chain().upcast("OrderPlaced", 1, {"customer": "c"})
    assert not failed.value.retriable


@pytest.mark.parametrize(("type_", "version", "message"), [
    ("", 1, "non-empty string"), ("T", 0, "integer >= 1"), ("T", True, "integer >= 1"), ("T", "1", "integer >= 1"),
])
def test_bad_registrations_are_refused(type_: Any, version: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Upcasters().register(type_, version)


def test_one_step_registered_twice_is_refused() -> None:
    ups = chain()
    with pytest.raises(ConfigurationError, match="registered twice"):
        ups.register("OrderPlaced", version=1)
