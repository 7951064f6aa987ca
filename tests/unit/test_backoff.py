"""Retry delays: exponential, capped, jittered in [d/2, d]."""

from __future__ import annotations

import pytest

from outbox_relay.backoff import Backoff


@pytest.mark.parametrize("attempt", [1, 2, 3, 5, 8, 10])
def test_delay_is_within_half_and_full_exponential_step(attempt: int) -> None:
    backoff = Backoff(base=1.0, cap=600.0)
    ceiling = min(600.0, 2.0 ** (attempt - 1))
    delays = [backoff.delay(attempt) for _ in range(200)]
    assert all(ceiling / 2 <= d <= ceiling for d in delays)
    assert max(delays) - min(delays) > ceiling / 10, "jitter spreads retries of many keys"


def test_grows_until_the_cap_then_stays_there() -> None:
    backoff = Backoff(base=0.5, cap=10.0)
    assert all(backoff.delay(1) <= 0.5 for _ in range(50))
    assert all(5.0 <= backoff.delay(a) <= 10.0 for a in range(6, 40) for _ in range(10))


def test_attempt_zero_or_less_is_treated_as_first() -> None:
    backoff = Backoff(base=2.0, cap=100.0)
    assert all(1.0 <= backoff.delay(a) <= 2.0 for a in (0, -3))


def test_constants_shrink_for_tests() -> None:
    fast = Backoff(base=0.01, cap=0.05)
    assert max(fast.delay(a) for a in range(1, 30)) <= 0.05


def test_cap_holds_for_huge_attempt_numbers() -> None:
    assert Backoff(base=1.0, cap=600.0).delay(5000) <= 600.0
