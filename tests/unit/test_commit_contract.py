"""``sink.Commit``'s whole contract, as a commit that writes only at the end keeps it: nothing written
early, ``later`` written at once, no transaction of a sink's own."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from outbox_relay.sinks.engine import CommitAtEnd, Outcomes


def test_a_commit_that_writes_only_at_the_end_writes_nothing_early_and_later_at_once() -> None:
    calls: list[tuple[Outcomes, Any]] = []

    def write(outcomes: Outcomes, tx: Any) -> set[int]:
        calls.append((outcomes, tx))
        return {3}

    commit = CommitAtEnd.of(write)
    done: Outcomes = {uuid.uuid4(): None}
    assert commit.partial(done) == set() and calls == []
    assert commit.later(done) == {3} and calls == [(done, None)]
    assert commit(done, "tx") == {3} and calls[-1] == (done, "tx")
    with pytest.raises(NotImplementedError):
        asyncio.run(commit.in_async(done, None))  # type: ignore[arg-type]
