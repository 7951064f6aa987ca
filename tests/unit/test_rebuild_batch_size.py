"""A rebuild of a batched projection reads larger batches than the live relay unless a batch size
was chosen."""

from __future__ import annotations

from typing import Any

import pytest

from outbox_relay.settings import load_settings
from projections import projection
from projections.rebuild import REBUILD_BATCH_SIZE, Rebuild


@projection("rebuilt", events=["t.x"], tables=["rebuilt"], batch=True)
def rebuilt(events: list[Any], tx: Any) -> None:
    pass


@projection("one_by_one", events=["t.x"], tables=["one_by_one"])
def one_by_one(event: Any, tx: Any) -> None:
    pass


DSN = "postgresql://u@h/db"


def test_a_batched_rebuild_reads_its_own_larger_batches_unless_a_batch_size_is_chosen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOX_BATCH_SIZE", raising=False)
    default = load_settings(dsn=DSN).batch_size
    assert Rebuild(rebuilt, load_settings(dsn=DSN), progress=None).batch_size == REBUILD_BATCH_SIZE > default
    assert Rebuild(rebuilt, load_settings(dsn=DSN, batch_size=default), progress=None).batch_size == default
    assert Rebuild(one_by_one, load_settings(dsn=DSN), progress=None).batch_size == default
    # The bulk phase's slices: large for both kinds of handler, unless a batch size is chosen.
    assert Rebuild(one_by_one, load_settings(dsn=DSN), progress=None).slice_size == REBUILD_BATCH_SIZE
    assert Rebuild(rebuilt, load_settings(dsn=DSN), progress=None).slice_size == REBUILD_BATCH_SIZE
    assert Rebuild(one_by_one, load_settings(dsn=DSN, batch_size=300), progress=None).slice_size == 300
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "250")
    assert Rebuild(rebuilt, load_settings(dsn=DSN), progress=None).batch_size == 250
