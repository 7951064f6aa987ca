"""The NATS JetStream sink against a real nats-server (tests/nats_server.py): the contract suite, settings and
their errors, routing, the message format, conditions of the sink against faults of the event, secrets, acks."""

from __future__ import annotations

import contextlib
import json
import logging
import urllib.parse
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_relay.errors import ConfigurationError
from outbox_relay.nats_settings import NatsSettings
from outbox_relay.publish import Outbox
from outbox_relay.settings import load_settings
from outbox_relay.sinks.nats import NatsSink, from_settings, subject_token
from outbox_relay.sinks.nats.readback import read_back
from outbox_relay.testing import SinkContract
from outbox_relay.testing.sink_harness import Harness
from tests.nats_server import ExternalNats, Namespace, PrivateNats, namespace, run, start_nats

SECRET = "pa55-W0rd-xyzzy"


@pytest.fixture(autouse=True)
def _cursor_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kit's runners read OUTBOX_* too: every batch writes its cursor, so that "settled" is seen at once
    (deferred cursor writes are tests/integration/test_cursor_writes.py's)."""
    monkeypatch.setenv("OUTBOX_CURSOR_FLUSH_SECONDS", "0")


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
        nats_server.start()  # a test that stopped it and failed
    with namespace(nats_server.url) as made:
        yield made


def fields(url: str, space: Namespace, **more: Any) -> NatsSettings:
    return NatsSettings(nats_url=url, nats_subject_prefix=space.prefix, **more)


def restartable(server: PrivateNats | ExternalNats) -> PrivateNats:
    if not isinstance(server, PrivateNats):
        pytest.skip("OUTBOX_TEST_NATS_URL: a server this test can not stop")
    return server


class TestNatsSinkContract(SinkContract):
    """Every test of the suite; ``received`` is what the stream holds (read_back). Down: the server killed
    and started again on its port and data directory; rejects: the stream's max_msg_size below every
    message; hangs: the server stopped (SIGSTOP) with the ack timeout past the suite's time limit."""

    @pytest.fixture(autouse=True)
    def _nats(self, nats_server: PrivateNats | ExternalNats, space: Namespace) -> None:
        self.server, self.space = nats_server, space

    def make_sink(self) -> Any:
        return NatsSink(self.server.url, subject_prefix=self.space.prefix, ack_timeout_seconds=3.0,
                        unavailable_seconds=0.2, concurrency=4)

    def received(self, sink: Any) -> Sequence[uuid.UUID]:
        return [i for i, _, _ in read_back(fields(self.server.url, self.space))]

    def break_downstream(self, sink: Any, how: str) -> contextlib.AbstractContextManager[None]:
        return self._broken(how)

    @contextlib.contextmanager
    def _broken(self, how: str) -> Iterator[None]:
        if how == "rejects":
            self.space.update(max_msg_size=16)
            try:
                yield
            finally:
                self.space.update(max_msg_size=-1)
            return
        server = restartable(self.server)
        if how == "down":
            server.kill()
            try:
                yield
            finally:
                server.start()
        else:
            server.pause()
            try:
                yield
            finally:
                server.resume()


# -- the engine around the sink, for the tests below ------------------------------------------------


class Suite:
    """What ``Harness`` asks of a suite: the sink under test and how long to wait."""

    topic = "orders"
    event_type = "OrderPlaced"
    settle_seconds = 20.0

    def __init__(self, sink: NatsSink) -> None:
        self.sink = sink

    def make_sink(self) -> NatsSink:
        return self.sink

    def received(self, sink: Any) -> None:
        return None


@pytest.fixture
def harness_for(dsn: str) -> Iterator[Any]:
    made: list[Harness] = []

    def make(sink: NatsSink) -> Harness:
        harness = Harness(Suite(sink), dsn)  # type: ignore[arg-type]
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()


def publish(dsn: str, events: list[dict[str, Any]]) -> list[uuid.UUID]:
    """In one transaction, in order; an event with topic None is written in SQL (Outbox refuses one)."""
    ids = []
    with psycopg.connect(dsn) as conn, conn.transaction():
        for e in events:
            if e.get("topic") is None:
                ids.append(conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload) "
                                        "VALUES (NULL, %s, %s, %s) RETURNING id",
                                        (e["key"], e["type"], json.dumps(e["payload"]))).fetchone()[0])
            else:
                ids.append(Outbox().publish(conn, **e).id)
    return ids


def sink_for(server: PrivateNats | ExternalNats, space: Namespace, **kw: Any) -> NatsSink:
    kw.setdefault("unavailable_seconds", 0.1)
    return NatsSink(server.url, subject_prefix=space.prefix, **kw)


def stored(server: PrivateNats | ExternalNats, space: Namespace) -> list[Any]:
    """Every message of the stream, with headers, in stream order."""
    async def get(js: Any) -> list[Any]:
        info = await js.stream_info(space.stream)
        return [await js.get_msg(space.stream, seq) for seq in range(info.state.first_seq, info.state.last_seq + 1)
                if info.state.messages]

    import nats

    async def main() -> list[Any]:
        nc = await nats.connect(server.url)
        try:
            return await get(nc.jetstream())
        finally:
            await nc.close()

    return list(run(main()))


# -- routing and the message ---------------------------------------------------------------------------


def test_subjects_are_prefix_topic_and_one_token_per_key(nats_server: Any, space: Namespace, dsn: str,
                                                         harness_for: Any) -> None:
    h = harness_for(sink_for(nats_server, space, default_topic="fallback"))
    keys = ["order:1", "a.b", "* >", "100%", "ü-ß", "$x"]
    ids = publish(dsn, [{"key": k, "type": "T", "payload": {"n": n}, "topic": "orders.eu" if n % 2 else None}
                        for n, k in enumerate(keys)])
    h.run_until_settled(h.runner())
    got = {i: (key, subject) for i, key, subject in read_back(fields(nats_server.url, space))}
    assert sorted(got) == sorted(ids)
    for n, (key, subject) in enumerate(got[i] for i in ids):
        topic = "orders.eu" if n % 2 else "fallback"
        assert key == keys[n]
        assert subject == f"{space.prefix}.{topic}.{subject_token(key)}"
        token = subject.rsplit(".", 1)[1]
        assert token and not set(token) & set(".*> \t%") - {"%"} and urllib.parse.unquote(token) == key
    assert sorted(i for i, _, _ in read_back(fields(nats_server.url, space), topics=["orders.eu"])) == sorted(ids[1::2])


def test_an_event_without_a_usable_topic_is_dead_lettered_with_the_reason(nats_server: Any, space: Namespace,
                                                                          dsn: str, harness_for: Any) -> None:
    h = harness_for(sink_for(nats_server, space))
    no_topic, after = publish(dsn, [{"key": "k", "type": "T", "payload": 1},
                                    {"key": "k", "type": "T", "payload": 2, "topic": "orders"}])
    h.run_until_settled(h.runner())
    dead = h.dead_letters()
    assert list(dead) == [no_topic] and "no topic" in dead[no_topic][1]
    assert [i for i, _, _ in read_back(fields(nats_server.url, space))] == [after]


def test_the_message_carries_cloudevents_headers_the_msg_id_and_the_stored_payload(
        nats_server: Any, space: Namespace, dsn: str, harness_for: Any, caplog: pytest.LogCaptureFixture) -> None:
    h = harness_for(sink_for(nats_server, space, source="billing/eu"))
    [event_id] = publish(dsn, [{"key": "order 9", "type": "Order Placed", "topic": "orders",
                                "payload": {"b": 1, "a": [1, 2]}, "version": 3,
                                "headers": {"traceparent": "00-abc-01", "Nats-Rollup": "all", "ce-custom": "x"}}])
    with caplog.at_level(logging.WARNING, "outbox_relay.nats"):
        h.run_until_settled(h.runner())
    [msg] = stored(nats_server, space)
    headers = msg.headers
    assert headers["Nats-Msg-Id"] == headers["ce-id"] == str(event_id)
    assert headers["ce-specversion"] == "1.0" and headers["ce-type"] == "Order%20Placed"
    assert headers["ce-source"] == "billing/eu" and headers["ce-partitionkey"] == "order%209"
    assert headers["ce-datacontenttype"] == "application/json" and headers["ce-schemaversion"] == "3"
    assert headers["ce-topic"] == "orders" and headers["ce-time"].endswith("Z")
    assert headers["traceparent"] == "00-abc-01" and "Nats-Rollup" not in headers and "ce-custom" not in headers
    assert "Nats-Rollup" in caplog.text
    with psycopg.connect(dsn) as conn:
        [(payload,)] = conn.execute("SELECT payload::text FROM outbox.events WHERE id = %s", (event_id,)).fetchall()
    assert msg.data.decode() == payload


# -- conditions of the sink, faults of the event, acks -------------------------------------------------


def test_no_stream_holds_the_events_without_attempts_until_one_exists(nats_server: Any, dsn: str,
                                                                      harness_for: Any) -> None:
    space = Namespace(nats_server.url, f"t{uuid.uuid4().hex[:10]}", f"OUTBOX_TEST_{uuid.uuid4().hex[:10]}")
    h = harness_for(NatsSink(nats_server.url, subject_prefix=space.prefix, unavailable_seconds=0.1))
    ids = publish(dsn, [{"key": f"k{n % 2}", "type": "T", "payload": n, "topic": "orders"} for n in range(4)])
    runner = h.runner(max_attempts=2)
    h.run_until(runner, lambda: len(h.parked()) >= 1)
    for _ in range(5):
        runner.run_once()
    assert h.dead_letters() == {}
    heads = [(n, e or "") for n, e in h.parked().values() if e is not None]  # the others wait behind them
    assert heads and all(n == 0 and "no stream takes this subject" in e for n, e in heads), h.parked()
    space.create()
    try:
        h.run_until_settled(runner)
        assert sorted(i for i, _, _ in read_back(fields(nats_server.url, space))) == sorted(ids)
    finally:
        space.delete()


def test_acks_decide_delivery_a_full_stream_holds_its_events(nats_server: Any, space: Namespace, dsn: str,
                                                              harness_for: Any) -> None:
    """The stream takes 3 messages (discard new) and refuses the rest in its PubAck: the refused events are not
    delivered (a sink that published without waiting for the ack, or ignored an error ack, loses them here)."""
    space.update(max_msgs=3, discard="new")
    h = harness_for(sink_for(nats_server, space))
    ids = publish(dsn, [{"key": f"k{n}", "type": "T", "payload": n, "topic": "orders"} for n in range(5)])
    runner = h.runner(max_attempts=2)
    h.run_until(runner, lambda: len(h.parked()) == 2)
    for _ in range(5):
        runner.run_once()
    assert h.dead_letters() == {} and len(h.parked()) == 2
    assert all(n == 0 and "maximum messages exceeded" in (e or "") for n, e in h.parked().values()), h.parked()
    assert space.messages() == 3
    space.update(max_msgs=-1)
    h.run_until_settled(runner)
    assert sorted(i for i, _, _ in read_back(fields(nats_server.url, space))) == sorted(ids)


def test_a_redelivery_within_the_duplicate_window_is_stored_once(nats_server: Any, space: Namespace, dsn: str,
                                                                 harness_for: Any) -> None:
    h = harness_for(sink_for(nats_server, space))
    ids = publish(dsn, [{"key": "k", "type": "T", "payload": n, "topic": "orders"} for n in range(5)])
    first = h.runner()
    before = h.cursors()
    h.run_until_settled(first)
    h.crash_before_checkpoint(before)
    h.run_until_settled(h.runner(worker_id="second"))
    assert h.delivered_ids().count(ids[0]) == 2, "delivered twice (PubAck duplicate=True counts delivered)"
    assert [i for i, _, _ in read_back(fields(nats_server.url, space))] == ids


def test_too_large_for_the_stream_or_the_server_is_dead_lettered_at_once(nats_server: Any, space: Namespace,
                                                                         dsn: str, harness_for: Any) -> None:
    space.update(max_msg_size=2000)
    h = harness_for(sink_for(nats_server, space))
    big, huge, small = publish(dsn, [{"key": "k", "type": "T", "payload": "x" * 3000, "topic": "orders"},
                                     {"key": "k", "type": "T", "payload": "x" * (1 << 20), "topic": "orders"},
                                     {"key": "k", "type": "T", "payload": 1, "topic": "orders"}])
    h.run_until_settled(h.runner(max_attempts=5))
    dead = h.dead_letters()
    assert set(dead) == {big, huge}
    assert dead[big][0] == 1 and "message size exceeds maximum allowed" in dead[big][1]
    assert dead[huge][0] == 1 and "max_payload" in dead[huge][1]
    assert [i for i, _, _ in read_back(fields(nats_server.url, space))] == [small]


def test_a_server_away_holds_and_nothing_is_counted_then_all_arrive(nats_server: Any, space: Namespace, dsn: str,
                                                                    harness_for: Any) -> None:
    server = restartable(nats_server)
    h = harness_for(sink_for(server, space, connect_timeout_seconds=0.5))
    ids = publish(dsn, [{"key": f"k{n % 3}", "type": "T", "payload": n, "topic": "orders"} for n in range(9)])
    runner = h.runner(max_attempts=1)
    h.run_until(runner, lambda: h.undelivered() < 9)  # connected and delivering
    server.kill()
    try:
        ids += publish(dsn, [{"key": f"k{n % 3}", "type": "T", "payload": n, "topic": "orders"} for n in range(3)])
        h.run_until(runner, lambda: len(h.parked()) >= 1)
        for _ in range(5):
            runner.run_once()
        assert h.dead_letters() == {} and all(n == 0 for n, _ in h.parked().values()), h.parked()
    finally:
        server.start()
    h.run_until_settled(runner)
    got = [i for i, _, _ in read_back(fields(server.url, space))]
    assert sorted(set(got)) == sorted(ids) and h.dead_letters() == {}


# -- credentials and secrets ----------------------------------------------------------------------------


def test_refused_credentials_hold_and_no_secret_reaches_a_reason_or_a_log(dsn: str, harness_for: Any,
                                                                          tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    server = PrivateNats(tmp_path).start("--user", "relay", "--pass", "right-one")
    try:
        with namespace(f"nats://relay:right-one@127.0.0.1:{server.port}") as space:
            url = f"nats://relay:{SECRET}@127.0.0.1:{server.port}"
            h = harness_for(NatsSink(url, subject_prefix=space.prefix, unavailable_seconds=0.1))
            publish(dsn, [{"key": "k", "type": "T", "payload": 1, "topic": "orders"}])
            runner = h.runner(max_attempts=1)
            with caplog.at_level(logging.DEBUG):
                h.run_until(runner, lambda: len(h.parked()) == 1)
                for _ in range(3):
                    runner.run_once()
            [(attempts, error)] = h.parked().values()
            assert attempts == 0 and h.dead_letters() == {}
            assert "can not connect" in (error or "") and "uthorization" in (error or ""), error
            assert SECRET not in (error or "") and SECRET not in caplog.text and SECRET not in repr(h.sink)
            h.sink.close()
            good = NatsSink(url.replace(SECRET, "right-one"), subject_prefix=space.prefix)
            h2 = harness_for(good)
            h2.run_until_settled(h2.runner())
            assert space.messages() == 1
    finally:
        server.close()


# -- settings --------------------------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(("options", "words"), [
    ({"nats_url": "http://h:4222"}, "nats:// or tls://"),
    ({"nats_url": f"nats://u:{SECRET}@h:4222/path"}, "no path or query"),
    ({"nats_url": "nats://h:99999"}, "not a URL"),
    ({"nats_url": "nats://h", "nats_subject_prefix": "a.*"}, "--nats-subject-prefix"),
    ({"nats_url": "nats://h", "nats_subject_prefix": "$JS"}, "no '$'"),
    ({"nats_url": "nats://h", "nats_topics": "orders,a..b"}, "empty token"),
    ({"nats_url": "nats://h", "nats_password": SECRET}, "needs --nats-user"),
    ({"nats_url": "nats://h", "nats_user": "u", "nats_password": SECRET, "nats_password_file": "/x"}, "once"),
    ({"nats_url": "nats://h", "nats_client_key": "/k.pem"}, "needs --nats-client-cert"),
    ({"nats_url": "nats://h", "nats_concurrency": "0"}, "--nats-concurrency"),
    ({"nats_url": "nats://h", "nats_sink": "Bad Name"}, "nats_sink"),
])
def test_bad_settings_are_refused_by_name_and_never_echo_a_secret(clean_env: None, options: dict[str, str],
                                                                   words: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_settings(dsn="postgresql://relay@db.invalid/app", **options)
    assert words in str(caught.value) and SECRET not in str(caught.value), str(caught.value)


def test_settings_from_the_environment_make_the_sink(clean_env: None, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    (tmp_path / "pw").write_text(SECRET + "\n")
    monkeypatch.setenv("OUTBOX_DSN", "postgresql://relay@db.invalid/app")
    monkeypatch.setenv("OUTBOX_NATS_URL", "nats://127.0.0.1:4222,nats://127.0.0.2:4222")
    monkeypatch.setenv("OUTBOX_NATS_USER", "relay")
    monkeypatch.setenv("OUTBOX_NATS_PASSWORD_FILE", str(tmp_path / "pw"))
    monkeypatch.setenv("OUTBOX_NATS_TOPICS", "orders, users")
    monkeypatch.setenv("OUTBOX_NATS_SUBJECT_PREFIX", "app.events")
    settings = load_settings()
    assert "nats" in settings.sinks
    sink = from_settings(settings, settings.source, "orders")
    assert sink.topics == {"orders", "users"} and sink.prefix == "app.events" and sink.kind == "nats"
    assert sink.connection.options.password == SECRET and SECRET not in repr(sink.connection.options)
    assert sink.endpoint == "nats://127.0.0.1:4222,nats://127.0.0.2:4222"


def test_run_help_lists_the_nats_options_and_no_secret_option() -> None:
    from outbox_relay.cli import build_parser

    run_parser = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    text = run_parser.format_help()
    for option in ("--nats-url", "--nats-subject-prefix", "--nats-stream", "--nats-ack-timeout-seconds",
                   "--nats-password-file", "--nats-creds-file", "--nats-concurrency", "--nats-topics"):
        assert option in text
    assert "--nats-password " not in text and "--nats-token " not in text and "OUTBOX_NATS_PASSWORD" in text


def test_a_subject_the_account_may_not_publish_to_holds_its_events_with_the_servers_word(
        dsn: str, harness_for: Any, tmp_path: Path) -> None:
    """An ACL that denies the subject is a condition of the sink: the server answers the publish with a
    permissions error and no PubAck; the events wait (no attempt counted), the reason quotes the server."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    (tmp_path / "server.conf").write_text(
        'authorization { users = [ { user: "relay", password: "pw-relay", permissions: { publish: { allow: [">"], '
        f'deny: ["{prefix}.secret.>"] }} }} }} ] }}\n')
    server = PrivateNats(tmp_path).start("-c", str(tmp_path / "server.conf"))
    try:
        with namespace(f"nats://relay:pw-relay@127.0.0.1:{server.port}") as space:
            space.prefix = prefix
            space.update(subjects=[f"{prefix}.>"])
            h = harness_for(NatsSink(f"nats://relay:pw-relay@127.0.0.1:{server.port}", subject_prefix=prefix,
                                     ack_timeout_seconds=0.3, unavailable_seconds=0.1))
            denied, allowed = publish(dsn, [{"key": "k1", "type": "T", "payload": 1, "topic": "secret"},
                                            {"key": "k2", "type": "T", "payload": 2, "topic": "orders"}])
            runner = h.runner(max_attempts=1)
            h.run_until(runner, lambda: denied in h.parked() and h.parked()[denied][1] is not None)
            for _ in range(3):
                runner.run_once()
            attempts, error = h.parked()[denied]
            assert attempts == 0 and h.dead_letters() == {}, h.parked()
            assert "no PubAck" in (error or "") and "ermission" in (error or ""), error
            assert [i for i, _, _ in read_back(NatsSettings(nats_url=space.url, nats_subject_prefix=prefix))] \
                == [allowed]
    finally:
        server.close()
