"""What a sink is: something that takes an ordered batch and says, per event, how it went."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .store import Checkpoint, Conn, StoredEvent


@dataclass(frozen=True)
class Failure:
    error: str
    retriable: bool = True


# Per event id: None = delivered, Failure = failed; an id that is absent was not attempted.
Outcomes = dict[uuid.UUID, Failure | None]

# Writes the checkpoint (with the sink's own transaction when it has one) and returns the
# buckets whose fence held.
CommitFn = Callable[[Outcomes, Conn | None], set[int]]


class Aborted(Exception):
    """Hard stop while a batch was in flight: nothing is checkpointed, the next owner redelivers."""


class Sink(Protocol):
    name: str
    kind: str

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: CommitFn,
                abort: threading.Event) -> set[int]:
        """Deliver ``events`` (in position order per bucket), then call ``commit`` exactly once.

        Returns what ``commit`` returned. Raises Aborted if ``abort`` was set mid-batch.
        """
        ...

    def close(self) -> None: ...


__all__ = ["Aborted", "Checkpoint", "CommitFn", "Failure", "Outcomes", "Sink"]
