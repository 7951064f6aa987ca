"""A batch's outcome (``Checkpoint``): what one fenced statement writes once a batch landed."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .positions import Cursor
from .sqlfiles import query
from .stored_event import StoredEvent


@dataclass
class Checkpoint:
    """The outcome of one batch, written by one fenced statement."""

    fences: dict[int, int]  # bucket -> fence token of every bucket this batch touched
    advance: dict[int, Cursor] = field(default_factory=dict)  # bucket -> its cursor once this batch landed
    park: list[tuple[StoredEvent, int, float, str | None]] = field(default_factory=list)  # attempts, delay, error
    done: list[StoredEvent] = field(default_factory=list)  # parked events that left the park
    dead: list[tuple[StoredEvent, int, str]] = field(default_factory=list)  # attempts, error
    resets: set[int] = field(default_factory=set)  # buckets that proved healthy: lapses back to 0
    # Buckets of ``advance`` whose cursor is not written now, only fenced (the runner writes it later:
    # SinkRunner._deferrable). Only in a checkpoint that moves cursors only.
    defer: set[int] = field(default_factory=set)
    # A checkpoint that moves cursors only renews the leases of the rows it writes for this long (the
    # runner's lease_seconds; None: the leases stay as they are).
    lease_seconds: float | None = None
    delivered: list[StoredEvent] = field(default_factory=list)  # what the sink delivered (for observers)
    landed_at: datetime | None = None  # the database's clock when the checkpoint was written (set by it)

    @property
    def moves_only(self) -> bool:
        """Whether it only moves cursors (nothing parked, unparked or dead-lettered): most batches."""
        return not (self.park or self.done or self.dead)

    def statement(self) -> str:
        """What writes it: ``relay.advance`` (cursors only) or the whole ``relay.checkpoint``."""
        return query("relay", "advance" if self.moves_only else "checkpoint")

    def params(self, sink: str, worker: str) -> dict[str, Any]:
        buckets = sorted(self.fences)
        cursors = [self.advance[b].params() if b in self.advance else (None, None, None, None) for b in buckets]
        moves: dict[str, Any] = {
            "sink": sink,
            "worker": worker,
            "buckets": buckets,
            "fences": [self.fences[b] for b in buckets],
            "seen": [c[0] for c in cursors],
            "targets": [c[1] for c in cursors],
            "after_xids": [c[2] for c in cursors],
            "after_seqs": [c[3] for c in cursors],
            "resets": [b in self.resets for b in buckets],
        }
        if self.defer and not self.moves_only:
            raise ValueError("a checkpoint that parks, unparks or dead-letters writes every cursor it moves")
        moves["writes"] = [b not in self.defer for b in buckets]
        moves["lease_seconds"] = self.lease_seconds
        if self.moves_only:
            return moves
        return {
            **moves,
            "park_buckets": [e.bucket for e, *_ in self.park],
            "park_xids": [e.xid for e, *_ in self.park],
            "park_seqs": [e.seq for e, *_ in self.park],
            "park_keys": [e.key for e, *_ in self.park],
            "park_ids": [e.id for e, *_ in self.park],
            "park_attempts": [a for _, a, _, _ in self.park],
            "park_delays": [d for _, _, d, _ in self.park],
            "park_errors": [err for *_, err in self.park],
            # Read from the park: rescheduled in place, never parked anew (see ``checkpoint``).
            "park_parked": [e.parked for e, *_ in self.park],
            "done_buckets": [e.bucket for e in self.done],
            "done_xids": [e.xid for e in self.done],
            "done_seqs": [e.seq for e in self.done],
            "dead_buckets": [e.bucket for e, _, _ in self.dead],
            "dead_xids": [e.xid for e, _, _ in self.dead],
            "dead_seqs": [e.seq for e, _, _ in self.dead],
            "dead_keys": [e.key for e, _, _ in self.dead],
            "dead_ids": [e.id for e, _, _ in self.dead],
            "dead_attempts": [a for _, a, _ in self.dead],
            "dead_errors": [err for _, _, err in self.dead],
        }
