"""FenceToken's text form: it sorts like the token, parses back, and reads tokens written before reads
were numbered (FENCE-XID-SEQ)."""

from __future__ import annotations

import random

import pytest

from projections import FenceToken

BIG = 2**63 - 1  # fences, xids and seqs are bigint in the database


def old_text(fence: int, xid: int, seq: int) -> str:
    """A token as relays wrote it before reads were numbered."""
    return f"{fence:020d}-{xid:020d}-{seq:020d}"


def test_the_text_sorts_like_the_token_and_parses_back() -> None:
    rng = random.Random(7)
    values = [0, 1, 2, 9, 10, 99, 100, BIG - 1, BIG]
    tokens = {FenceToken(*(rng.choice(values) if rng.random() < 0.5 else rng.randrange(BIG) for _ in range(4)))
              for _ in range(2000)}
    tokens |= {FenceToken(4, 1, 900, 2), FenceToken(4, 2, 800, 1), FenceToken(5, 1, 1, 1)}
    assert sorted(tokens, key=str) == sorted(tokens)
    assert all(FenceToken.parse(str(t)) == t for t in tokens)
    # Read before position: a later read of the same fence outranks a larger (xid, seq).
    assert FenceToken(4, 1, 900, 2) < FenceToken(4, 2, 800, 1) and str(FenceToken(4, 1, 900, 2)) < str(
        FenceToken(4, 2, 800, 1))


def test_an_old_three_part_token_parses_with_read_zero_and_sorts_below_a_later_fence() -> None:
    assert FenceToken.parse(old_text(7, 900, 2)) == FenceToken(7, 0, 900, 2)
    rng = random.Random(11)
    # After an upgrade every new token's fence is above every old one's (each acquisition bumps it):
    # whatever the other numbers, as text and as tokens, old < new.
    for _ in range(2000):
        old_fence = rng.randrange(BIG - 1)
        new_fence = rng.randrange(old_fence + 1, BIG)
        old = old_text(old_fence, rng.randrange(BIG), rng.randrange(BIG))
        new = FenceToken(new_fence, rng.randrange(1, BIG), rng.randrange(BIG), rng.randrange(BIG))
        assert old < str(new)
        assert FenceToken.parse(old) < new
    # And an old relay that acquired the bucket after a new one (a rolling deploy) outranks it.
    assert str(FenceToken(5, 9, 9, 9)) < old_text(6, 1, 1) and FenceToken(5, 9, 9, 9) < FenceToken.parse(
        old_text(6, 1, 1))


@pytest.mark.parametrize("text", ["", "7", "1-2", "1-2-3-4-5", "a-b-c", "1--2-3", "-1-2-3", "1-2-3-+4", "1 -2-3",
                                  "\u0661-2-3", None])
def test_what_is_not_a_token_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="not a fence token") as caught:
        FenceToken.parse(text)
    assert repr(text) in str(caught.value)
