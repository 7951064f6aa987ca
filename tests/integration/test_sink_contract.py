"""The contract suite (outbox_relay/testing/sink_contract.py) against every sink the project ships.

- the example sink of docs/writing-a-sink.md (examples/jsonl_sink.py), an ``EventSink`` through the
  adapter: every test, ``break_downstream("down")`` included (its directory taken away);
- an async ``EventSink``: every adapter test;
- an ``EventSink`` with ``deliver_many`` (waves, sinks/waves.py): every adapter test;
- ``RecordingSink`` (outbox_relay.testing), Kafka and a projection, engine sinks: every test but the
  two that are the adapter's own rules (an exception is a retry; the time limit), which are skipped.
  Their ``received`` is the downstream's own record: what the recorder kept, the topic read back,
  the projection's table.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest

from outbox_relay.sinks import SinkEvent
from outbox_relay.sinks.kafka import KafkaSink
from outbox_relay.testing import RecordingSink, SinkContract
from projections import ProjectionEvent, projection
from projections.sink import ProjectionSink
from tests.servers import consume_all

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


jsonl = example("jsonl_sink")


class TestExampleSink(SinkContract):
    @pytest.fixture(autouse=True)
    def _directory(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "logs"
        self.dir.mkdir()

    def make_sink(self) -> Any:
        return jsonl.JsonLinesSink(self.dir / "audit.jsonl", unavailable_seconds=0.2)

    def received(self, sink: Any) -> Sequence[uuid.UUID]:
        path = self.dir / "audit.jsonl"
        if not path.exists():
            return []
        import json

        return [uuid.UUID(json.loads(line)["id"]) for line in path.read_text().splitlines()]

    def break_downstream(self, sink: Any, how: str) -> contextlib.AbstractContextManager[None]:
        if how != "down":
            return super().break_downstream(sink, how)
        return self._directory_away()

    @contextlib.contextmanager
    def _directory_away(self) -> Iterator[None]:
        away = self.dir.with_name("away")
        self.dir.rename(away)
        try:
            yield
        finally:
            shutil.move(str(away), str(self.dir))


class AsyncSink:
    """An EventSink whose deliver is a coroutine function (run on the adapter's lanes' event loops)."""

    name = "async-audit"
    kind = "audit"
    concurrency = 2

    def __init__(self) -> None:
        self.got: list[uuid.UUID] = []

    async def deliver(self, event: SinkEvent) -> None:
        import asyncio

        await asyncio.sleep(0)
        self.got.append(event.id)


class TestAsyncEventSink(SinkContract):
    def make_sink(self) -> Any:
        return AsyncSink()

    def received(self, sink: Any) -> Sequence[uuid.UUID]:
        return list(sink.got)


class WaveSink:
    """An EventSink with ``deliver_many`` (the adapter's waves). It notes a call that holds two events of a key
    or more than ``concurrency`` (the adapter's promise: no answer in a wave can let a key's later event land
    first), and ``received`` fails the test on one."""

    name = "wave-audit"
    kind = "audit"
    concurrency = 3

    def __init__(self) -> None:
        self.got: list[uuid.UUID] = []
        self.broken: list[str] = []  # calls that broke the promise

    def deliver(self, event: SinkEvent) -> None:
        self.broken.append("deliver called: a sink with deliver_many is given waves only")

    def deliver_many(self, events: Sequence[SinkEvent]) -> list[None]:
        keys = [e.key for e in events]
        if len(set(keys)) < len(keys) or len(keys) > self.concurrency:
            self.broken.append(f"a call with keys {keys}")
        self.got.extend(e.id for e in events)
        return [None] * len(events)


class TestWaveSink(SinkContract):
    def make_sink(self) -> Any:
        return WaveSink()

    def received(self, sink: Any) -> Sequence[uuid.UUID]:
        assert not sink.broken, sink.broken
        return list(sink.got)


class TestRecordingSink(SinkContract):
    def make_sink(self) -> Any:
        return RecordingSink("recording")

    def received(self, sink: Any) -> Sequence[uuid.UUID]:
        return [d.event.id for d in sink.deliveries if d.error is None]


LOG_TABLE = "CREATE TABLE contract_log (n bigserial PRIMARY KEY, event_id uuid NOT NULL)"


@projection("contract_log", ["contract.Happened"], tables=["contract_log"])
def contract_log(event: ProjectionEvent[Any], tx: Any) -> None:
    tx.execute("INSERT INTO contract_log (event_id) VALUES (%s)", (event.id,))


class TestProjectionSink(SinkContract):
    def prepare_database(self, dsn: str) -> None:
        self.dsn = dsn
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(LOG_TABLE)

    def make_sink(self) -> Any:
        return ProjectionSink(contract_log, self.dsn)

    def received(self, sink: Any) -> Sequence[uuid.UUID]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return [r[0] for r in conn.execute("SELECT event_id FROM contract_log ORDER BY n")]


class TestKafkaSink(SinkContract):
    @pytest.fixture(autouse=True)
    def _broker(self, kafka_bootstrap: str, kafka_topic: str) -> None:
        self.bootstrap, self.topic = kafka_bootstrap, kafka_topic

    def make_sink(self) -> Any:
        return KafkaSink("kafka", {"bootstrap.servers": self.bootstrap}, None, "contract-test")

    def received(self, sink: Any) -> Sequence[uuid.UUID]:
        # Per key, the topic's order (one key, one partition, offset order); what the engine counted
        # delivered must all be there.
        messages = consume_all(self.bootstrap, self.topic, expected_count=1 << 30, timeout=2.0)
        messages.sort(key=lambda m: (m.partition, m.offset))
        return [uuid.UUID(m.headers["ce_id"] or "") for m in messages]
