"""A rebuild reads larger batches than the live relay unless a batch size was chosen."""

from __future__ import annotations

from typing import Any

import pytest

from outbox_relay.settings import load_settings
from projections import projection
from projections.rebuild import REBUILD_BATCH_SIZE, Rebuild


@projection("rebuilt", events=["t.x"], tables=["rebuilt"])
def rebuilt(event: Any, tx: Any) -> None:
    pass


DSN = "postgresql://u@h/db"


def test_a_rebuild_reads_its_own_larger_batches_unless_a_batch_size_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOX_BATCH_SIZE", raising=False)
    assert Rebuild(rebuilt, load_settings(dsn=DSN), progress=None).batch_size == REBUILD_BATCH_SIZE > 1000
    assert Rebuild(rebuilt, load_settings(dsn=DSN, batch_size=1000), progress=None).batch_size == 1000
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "250")
    assert Rebuild(rebuilt, load_settings(dsn=DSN), progress=None).batch_size == 250
