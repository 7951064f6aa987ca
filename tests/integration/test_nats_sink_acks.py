"""The NATS sink's publishes and PubAcks (outbox_relay/sinks/nats/acks.py) against a real nats-server: the
HPUB the sink writes carries what the client's own publish would, each answer is told apart, and no
publish leaves its future behind (a timeout, a cancel)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbox_relay.sinks.nats.acks import Acks, JetStreamError, NoStream
from tests.nats_server import ExternalNats, Namespace, PrivateNats, namespace, run, start_nats

HEADERS = {"traceparent": "00-abc-01", "x-padded": "  both sides  ", "x-utf8": "ü-ß 日", "Nats-Msg-Id": "m-1",
           "ce-type": "Order%20Placed"}


@pytest.fixture(scope="module")
def nats_server() -> Iterator[PrivateNats | ExternalNats]:
    server = start_nats()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def space(nats_server: PrivateNats | ExternalNats) -> Iterator[Namespace]:
    if isinstance(nats_server, PrivateNats) and not nats_server.running():
        nats_server.start()
    with namespace(nats_server.url) as made:
        yield made


def _pause(server: PrivateNats) -> None:
    """SIGSTOP, and wait until every thread of the server has stopped (kill() returns before they all have)."""
    server.pause()
    assert server.process is not None
    tasks = Path(f"/proc/{server.process.pid}/task")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
        if all(state in "Tt" for state in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"nats-server did not stop: {states}")


async def _acks(url: str) -> tuple[Any, Acks]:
    import nats

    nc = await nats.connect(url, pending_size=0)
    return nc, await Acks(nc).start()


def test_the_hpub_the_sink_writes_is_what_the_clients_publish_writes(nats_server: Any, space: Namespace) -> None:
    async def main() -> list[Any]:
        nc, acks = await _acks(nats_server.url)
        try:
            assert acks._raw  # the sink's own HPUB: this nats-py has the parts it is built from
            assert await acks.publish(f"{space.prefix}.a.k", b'{"n": 1}', dict(HEADERS), 5.0) is None
            acks._raw = False  # the client's publish, to compare with
            headers = {**HEADERS, "Nats-Msg-Id": "m-2"}
            assert await acks.publish(f"{space.prefix}.a.k", b'{"n": 1}', headers, 5.0) is None
            js = nc.jetstream()
            return [await js.get_msg(space.stream, seq) for seq in (1, 2)]
        finally:
            await nc.close()

    ours, theirs = run(main())
    assert ours.data == theirs.data == b'{"n": 1}' and ours.subject == theirs.subject
    assert {**ours.headers, "Nats-Msg-Id": "m-2"} == theirs.headers
    assert ours.headers["x-padded"] == "both sides" and str(ours.headers["x-utf8"]) == str(theirs.headers["x-utf8"])


def test_each_answer_is_told_apart_and_no_future_is_left_behind(nats_server: Any, space: Namespace) -> None:
    async def main() -> None:
        nc, acks = await _acks(nats_server.url)
        try:
            # a duplicate is a PubAck too
            for _ in range(2):
                assert await acks.publish(f"{space.prefix}.a.k", b"1", {"Nats-Msg-Id": "same"}, 5.0) is None
            with pytest.raises(NoStream):
                await acks.publish("nobody-takes.this", b"1", {"Nats-Msg-Id": "x"}, 5.0)
            error = await acks.publish(f"{space.prefix}.a.k", b"1", {"Nats-Expected-Stream": "ANOTHER"}, 5.0)
            assert isinstance(error, JetStreamError) and error.err_code == 10060 and error.code == 400, error
            assert "stream" in error.description
            assert not acks._waiting
        finally:
            await nc.close()

    run(main())
    assert space.messages() == 1


def test_a_publish_past_its_limit_or_cancelled_ends_and_leaves_nothing_behind(nats_server: Any,
                                                                              space: Namespace) -> None:
    if not isinstance(nats_server, PrivateNats):
        pytest.skip("OUTBOX_TEST_NATS_URL: a server this test can not stop")

    async def main() -> None:
        nc, acks = await _acks(nats_server.url)
        try:
            _pause(nats_server)
            try:
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    await acks.publish(f"{space.prefix}.a.k", b"1", {}, 0.3)
                assert 0.25 <= time.monotonic() - started < 2.0
                task = asyncio.ensure_future(acks.publish(f"{space.prefix}.a.k", b"2", {}, 60.0))
                await asyncio.sleep(0.1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert not acks._waiting
            finally:
                nats_server.resume()
        finally:
            await nc.close()

    run(main())
