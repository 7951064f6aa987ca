"""`outbox-relay run`, plus the time of the broker's acknowledgement of every event (bench only).

    python bench/ack_relay.py OUT.json [outbox-relay arguments ...]

The relay is the real command; an ``Observer.acknowledged`` hook records, per event id, when its first
delivery report with an offset was served (wall clock, like the producer's commit times), and the
``Observer.delivering`` scope times each batch: handed to the sink (read done), its last ack, landed
(the sink returned: after the fenced checkpoint, or, for a batch whose fence check rides on the relay's
next read, right after the acks). At exit (SIGTERM: the graceful drain) it writes
``{"acks": {id: seconds}, "batches": [[handed, last_ack, landed, events], ...]}`` to OUT.json. A Kafka
cursor is written at most every --cursor-flush-seconds, so a checkpoint's time is no ack time any more.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from outbox_relay import compose
from outbox_relay.cli import main
from outbox_relay.observer import Delivery, Observer


class _Landed(Delivery):
    at: float | None = None

    def landed(self, checkpoint: Any, buckets: set[int]) -> None:
        self.at = time.time()


class AckTimes(Observer):
    def __init__(self) -> None:
        # The sink's thread writes, the main thread reads at exit.
        self.first: dict[uuid.UUID, float] = {}
        self.batches: list[tuple[float, float | None, float | None, int]] = []
        self._last_ack: float | None = None

    def acknowledged(self, sink: str, event_ids: Sequence[uuid.UUID]) -> None:
        now = self._last_ack = time.time()
        for i in event_ids:
            self.first.setdefault(i, now)  # a redelivery's later ack does not count

    @contextlib.contextmanager
    def delivering(self, sink: Any, events: Sequence[Any]) -> Iterator[Delivery]:
        handed, self._last_ack = time.time(), None
        scope = _Landed()
        try:
            yield scope
        finally:
            self.batches.append((handed, self._last_ack, scope.at, len(events)))


class Reads:
    """How many reads the relay ran and how many found nothing (a wake-up for events an earlier read took)."""

    def __init__(self) -> None:
        self.reads = self.empty = 0

    def install(self) -> None:
        from outbox_relay import store

        real = store.fetch_events

        def counting(*args: Any, **kwargs: Any) -> Any:
            read = real(*args, **kwargs)
            self.reads += 1
            self.empty += not read.events
            return read

        store.fetch_events = counting  # type: ignore[assignment]


def run(out: str, argv: list[str]) -> int:
    acks = AckTimes()
    reads = Reads()
    reads.install()
    # `run` builds its worker through compose.build_worker(settings); the bench adds its observer there.
    compose.build_worker = functools.partial(compose.build_worker, observer=acks)
    try:
        return main(argv)
    finally:
        with open(out, "w") as f:
            json.dump({"acks": {str(i): t for i, t in list(acks.first.items())}, "batches": list(acks.batches),
                       "reads": reads.reads, "empty_reads": reads.empty}, f)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2:]))
