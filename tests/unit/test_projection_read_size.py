"""How much a live projection relay reads per batch: a batched projection reads BATCHED_READ_SIZE events
unless --batch-size is given (its read's per-bucket work and its checkpoint are spread over more events);
a per-event projection and every other sink read --batch-size."""

from __future__ import annotations

from typing import Any

from outbox_relay.compose import build_worker
from outbox_relay.relay import SinkRunner
from outbox_relay.settings import RelaySettings
from projections import projection
from projections.sink import BATCHED_READ_SIZE, ProjectionSink


@projection("read_size_batched", events=["t.x"], batch=True)
def batched(events: list[Any], tx: Any) -> None:
    pass


@projection("read_size_per_event", events=["t.x"])
def per_event(event: Any, tx: Any) -> None:
    pass


def sinks(**values: Any) -> dict[str, ProjectionSink]:
    settings = RelaySettings(dsn="postgresql://u@localhost/none", kafka=False, projections=__name__,
                             projection=["read_size_batched", "read_size_per_event"], **values)
    worker = build_worker(settings)
    out = {s.name: s for s in worker._sinks if isinstance(s, ProjectionSink)}
    for s in out.values():
        s.close()
    return out


def runner_batch(sink: ProjectionSink, **values: Any) -> int:
    settings = RelaySettings(dsn="postgresql://u@localhost/none", kafka=False, **values)
    return SinkRunner(sink, None, settings).reads.batch_size  # type: ignore[arg-type]


def test_a_batched_projection_reads_more_per_batch_unless_a_batch_size_is_given() -> None:
    default = sinks()
    assert default["read_size_batched"].batch_size == BATCHED_READ_SIZE
    assert default["read_size_per_event"].batch_size is None
    assert runner_batch(default["read_size_batched"]) == BATCHED_READ_SIZE
    assert runner_batch(default["read_size_per_event"]) == 1000
    chosen = sinks(batch_size=1000)
    assert chosen["read_size_batched"].batch_size is None
    assert runner_batch(chosen["read_size_batched"], batch_size=1000) == 1000


def test_the_relay_spreads_a_sink_read_size_over_its_buckets() -> None:
    runner = SinkRunner(sinks()["read_size_batched"], None, RelaySettings(  # type: ignore[arg-type]
        dsn="postgresql://u@localhost/none", kafka=False))
    limits = runner.reads.limits({b: 1 for b in range(64)})
    assert set(limits.values()) == {BATCHED_READ_SIZE // 64}
    assert runner.reads.bucket_limit(256) == BATCHED_READ_SIZE // 256
