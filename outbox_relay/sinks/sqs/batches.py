"""A wave's messages for one queue as SendMessageBatch requests: at most ``size`` messages and ``max_bytes``
each, in the wave's order (a larger message goes alone). The relay hands the sink the next event of each of
up to ``concurrency`` keys at once (sinks/waves.py), so a request never holds two events of one key."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

from .message import Message

BATCH_BYTES = 262_144  # SQS's limit on a batch's total size (256 KiB)

T = TypeVar("T")


def requests(line: Sequence[tuple[T, Message]], size: int, max_bytes: int = BATCH_BYTES
             ) -> Iterator[list[tuple[T, Message]]]:
    """``line`` (each message with what the caller keeps beside it) cut into requests."""
    batch: list[tuple[T, Message]] = []
    total = 0
    for item in line:
        if batch and (len(batch) == size or total + item[1].size > max_bytes):
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += item[1].size
    if batch:
        yield batch


__all__ = ["BATCH_BYTES", "requests"]
