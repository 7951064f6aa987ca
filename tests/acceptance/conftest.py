"""Fixtures of the acceptance tests: ``relays`` starts ``outbox-relay run`` processes for one test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_relay_processes import Relays


@pytest.fixture
def relays(tmp_path: Path) -> Iterator[Relays]:
    """Relay processes of one test; leftovers are killed and every relay's log tail printed at teardown."""
    fleet = Relays(tmp_path)
    try:
        yield fleet
    finally:
        fleet.close()
