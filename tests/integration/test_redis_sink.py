"""The Redis Streams sink against real Redis servers: the contract suite (a private ``redis-server`` per
test, so that it can be taken away, paused or made to refuse), then the sink as ``outbox-relay run``
builds it (compose.build_worker from settings with ``redis_url``): the entry's fields, routing, the
conditions of the sink against the faults of an event, the acknowledgement, secrets and TLS.

Tests that change nothing on the server use the machine's Redis (tests/redis_server.py: a key prefix
per test, deleted after); the others start their own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_relay.compose import build_worker
from outbox_relay.errors import ConfigurationError
from outbox_relay.publish import Outbox
from outbox_relay.redis_settings import RedisFields
from outbox_relay.settings import load_settings
from outbox_relay.sinks.redis import RedisStreamsSink
from outbox_relay.sinks.redis.readback import read_back
from outbox_relay.testing import SinkContract
from tests.cli_helpers import run_cli
from tests.integration.relay_helpers import (
    dead_letters,
    fetch_all,
    make_settings,
    parked_rows,
    publish,
    running,
    undelivered,
)
from tests.redis_server import PrivateRedis, namespace, private_redis, shared_url
from tests.servers import wait_until
from tests.webhook_receiver import self_signed

SINK = "redis"
PASSWORD = "s3cret-Redis-pass"


def fields(url: str, prefix: str, **more: Any) -> RedisFields:
    return RedisFields(redis_url=url, redis_stream_prefix=prefix, **more)


def relay(dsn: str, url: str, prefix: str, **overrides: Any) -> Any:
    values: dict[str, Any] = {"redis_url": url, "redis_stream_prefix": prefix, "redis_timeout_seconds": 2.0}
    values.update(overrides)
    return build_worker(make_settings(dsn, "w1", **values))


def pending(dsn: str) -> int:
    """Committed events the sink has not delivered: behind its cursors, or parked (held or retried). Before
    the relay (started on a thread) has registered the sink, that is every event: without its cursors the
    count behind them was 0, and a test under load read "all delivered" before anything was tried."""
    if not fetch_all(dsn, "SELECT count(*) FROM outbox.cursors WHERE sink = %s", (SINK,))[0][0]:
        return int(fetch_all(dsn, "SELECT count(*) FROM outbox.events")[0][0])
    parked = fetch_all(dsn, "SELECT count(*) FROM outbox.parked WHERE sink = %s", (SINK,))[0][0]
    return undelivered(dsn, SINK) + int(parked)


def settled(dsn: str) -> bool:
    """The sink is registered (its cursors exist) and has delivered (or dead-lettered) every committed event."""
    registered = fetch_all(dsn, "SELECT count(*) FROM outbox.cursors WHERE sink = %s", (SINK,))[0][0] > 0
    return bool(registered) and pending(dsn) == 0


def firsts_per_key(entries: Sequence[tuple[uuid.UUID, str, str]]) -> dict[str, list[uuid.UUID]]:
    """Per key, the ids in the order of their first entry (consumers dedupe by ``id``)."""
    seen: set[uuid.UUID] = set()
    out: dict[str, list[uuid.UUID]] = {}
    for event_id, key, _stream in entries:
        if event_id not in seen:
            seen.add(event_id)
            out.setdefault(key, []).append(event_id)
    return out


def per_key(events: Sequence[tuple[str, str, Any]], ids: Sequence[uuid.UUID]) -> dict[str, list[uuid.UUID]]:
    out: dict[str, list[uuid.UUID]] = {}
    for (key, _t, _p), event_id in zip(events, ids, strict=True):
        out.setdefault(key, []).append(event_id)
    return out


@pytest.fixture(autouse=True)
def _short_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("outbox_relay.sinks.redis.sink.UNAVAILABLE_SECONDS", 0.1)


@pytest.fixture(name="shared")
def shared_fixture() -> Iterator[tuple[str, str]]:
    url = shared_url()
    with namespace(url) as prefix:
        yield url, prefix


@pytest.fixture(name="server")
def server_fixture(tmp_path: Path) -> Iterator[PrivateRedis]:
    with private_redis(tmp_path / "redis") as server:
        yield server


# -- the contract ---------------------------------------------------------------------------------


class TestRedisSinkContract(SinkContract):
    """``received`` is what the stream holds (XRANGE): the broker's order, repeats included."""

    @pytest.fixture(autouse=True)
    def _server(self, tmp_path: Path) -> Iterator[None]:
        with private_redis(tmp_path / "redis") as server:
            self.server = server
            yield

    def make_sink(self) -> Any:
        # A timeout above the hang test's time limit (1 s): a paused server is a call that never returns.
        return RedisStreamsSink(self.server.url, stream_prefix="c:", timeout_seconds=3.0, unavailable_seconds=0.05)

    def received(self, sink: Any) -> Sequence[uuid.UUID]:
        return [event_id for event_id, _k, _s in read_back(fields(self.server.url, "c:"))]

    def break_downstream(self, sink: Any, how: str) -> contextlib.AbstractContextManager[None]:
        return self._broken(sink, how)

    @contextlib.contextmanager
    def _broken(self, sink: Any, how: str) -> Iterator[None]:
        if how == "down":
            self.server.kill()
            try:
                yield
            finally:
                self.server.start()
        elif how == "hangs":
            with self.server.paused():
                yield
        else:  # "rejects": every entry over the sink's limit, the one fault of an event Redis has
            sink.max_entry_bytes = 10
            try:
                yield
            finally:
                sink.max_entry_bytes = 1 << 20


# -- the entry, routing ---------------------------------------------------------------------------


def test_each_event_is_one_entry_with_the_cloudevents_fields_in_its_topics_stream(
        dsn: str, shared: tuple[str, str]) -> None:
    import redis

    url, prefix = shared
    outbox = Outbox()
    with psycopg.connect(dsn) as conn:
        first = outbox.publish(conn, type="OrderPlaced", key="order:1", topic="orders",
                               payload={"total": 12.5, "note": "caf\u00e9"}, headers={"trace": "t-1"})
        second = outbox.publish(conn, type="RefundIssued", key="order:1", topic="refunds", payload=[1, 2])
        row = conn.execute("INSERT INTO outbox.events (partition_key, type, payload) VALUES ('k', 'Pinged', 'null') "
                           "RETURNING id").fetchone()  # no topic (SQL producers may leave it out): --default-topic
        assert row is not None
    with running(relay(dsn, url, prefix, default_topic="misc", source="shop")):
        wait_until(lambda: settled(dsn), timeout=20, message="every event delivered")
    client = redis.Redis.from_url(url)
    try:
        [(entry_id, got)] = client.xrange(prefix + "orders")
        assert client.xlen(prefix + "refunds") == 1 and client.xlen(prefix + "misc") == 1
        [(_, misc)] = client.xrange(prefix + "misc")
    finally:
        client.close()
    assert entry_id  # the server's id, the acknowledgement
    text = {k.decode(): v.decode() for k, v in got.items()}
    stored_time = text.pop("time")
    assert text == {"specversion": "1.0", "id": str(first.id), "source": "shop", "type": "OrderPlaced",
                    "subject": "order:1", "datacontenttype": "application/json",
                    "data": text["data"], "header.trace": "t-1"}
    assert json.loads(text["data"]) == {"total": 12.5, "note": "caf\u00e9"}  # the stored JSON text, as stored
    assert stored_time.endswith("Z") and stored_time[:4].isdigit()
    assert misc[b"id"] == str(row[0]).encode() and misc[b"data"] == b"null"
    back = read_back(fields(url, prefix))
    assert {(i, s.removeprefix(prefix)) for i, _k, s in back} == {
        (first.id, "orders"), (second.id, "refunds"), (row[0], "misc")}
    assert read_back(fields(url, prefix), topics=["refunds"]) == [(second.id, "order:1", prefix + "refunds")]


def test_many_keys_arrive_once_each_in_order_per_key(dsn: str, shared: tuple[str, str]) -> None:
    url, prefix = shared
    events = [(f"key-{k}", "t", {"n": n}) for n in range(15) for k in range(8)]
    with running(relay(dsn, url, prefix, redis_concurrency=4)):
        ids = publish(dsn, events, topic="orders")
        wait_until(lambda: len(read_back(fields(url, prefix))) >= len(ids), timeout=20, message="every entry")
    back = read_back(fields(url, prefix))
    assert sorted(i for i, _k, _s in back) == sorted(ids), "each event once (no fault, no duplicate)"
    assert firsts_per_key(back) == per_key(events, ids)


def test_verify_reads_the_streams_back_clean_and_names_an_entry_lost(
        dsn: str, shared: tuple[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`outbox-relay verify --sink redis` end to end: the relay's streams check clean (exit 0); an entry
    deleted from a stream is named lost (exit 1)."""
    url, prefix = shared
    events = [(f"key-{k}", "t", {"n": n}) for n in range(4) for k in range(3)]
    with running(relay(dsn, url, prefix)):
        ids = publish(dsn, events, topic="orders")
        wait_until(lambda: settled(dsn), timeout=20, message="every event delivered")
    monkeypatch.setenv("OUTBOX_REDIS_URL", url)
    monkeypatch.setenv("OUTBOX_REDIS_STREAM_PREFIX", prefix)
    code, out, err = run_cli(capsys, "verify", "--sink", SINK, "--dsn", dsn, "--json")
    assert code == 0, out + err
    import redis

    client = redis.Redis.from_url(url)
    [entry] = [e for e, f in client.xrange(f"{prefix}orders") if f[b"id"].decode() == str(ids[5])]
    client.xdel(f"{prefix}orders", entry)
    client.close()
    code, out, err = run_cli(capsys, "verify", "--sink", SINK, "--dsn", dsn)
    assert code == 1 and str(ids[5]) in out and "lost" in out, out + err


def test_only_the_topics_asked_for_and_an_event_without_a_topic_is_dead_lettered(
        dsn: str, shared: tuple[str, str]) -> None:
    url, prefix = shared
    with running(relay(dsn, url, prefix, redis_topics="orders,refunds")):
        wanted = publish(dsn, [("k", "t", {"n": 1})], topic="orders")
        publish(dsn, [("k", "t", {"n": 2})], topic="payments")
        wait_until(lambda: settled(dsn), timeout=20, message="delivered")
    assert [i for i, _k, _s in read_back(fields(url, prefix))] == wanted
    with running(relay(dsn, url, prefix)):  # no --default-topic
        with psycopg.connect(dsn) as conn:
            found = conn.execute("INSERT INTO outbox.events (partition_key, type, payload) VALUES ('k2', 't', '{}') "
                                 "RETURNING id").fetchone()
        assert found is not None
        lost = found[0]
        wait_until(lambda: dead_letters(dsn, SINK), timeout=20, message="a dead letter")
    assert "no topic" in dead_letters(dsn, SINK)[lost][1]


def test_an_entry_over_the_limit_is_dead_lettered_at_once_and_its_key_goes_on(
        dsn: str, shared: tuple[str, str]) -> None:
    url, prefix = shared
    with running(relay(dsn, url, prefix, redis_max_entry_bytes=400)):
        big, small = publish(dsn, [("k", "t", {"blob": "x" * 500}), ("k", "t", {"n": 1})], topic="orders")
        wait_until(lambda: settled(dsn) and dead_letters(dsn, SINK), timeout=20, message="settled")
    dead = dead_letters(dsn, SINK)
    assert list(dead) == [big] and dead[big][0] == 1 and "over the Redis sink's limit of 400" in dead[big][1]
    assert [i for i, _k, _s in read_back(fields(url, prefix))] == [small]


def test_maxlen_trims_each_stream_to_about_that_many_entries(dsn: str, shared: tuple[str, str]) -> None:
    import redis

    url, prefix = shared
    with running(relay(dsn, url, prefix, redis_maxlen=10, redis_concurrency=1)):
        publish(dsn, [("k", "t", {"n": n}) for n in range(400)], topic="orders")
        wait_until(lambda: settled(dsn), timeout=30, message="delivered")
    client = redis.Redis.from_url(url)
    try:
        length = client.xlen(prefix + "orders")
    finally:
        client.close()
    assert 10 <= length < 400, "MAXLEN ~ trims by whole nodes (about 100 entries), never below the limit"


# -- conditions of the sink, and the acknowledgement ----------------------------------------------


def _held_then_delivered(dsn: str, server: PrivateRedis, refuse: Any, allow: Any, expected: str,
                         caplog: pytest.LogCaptureFixture) -> None:
    """While ``refuse`` holds, the server answers XADD with an error: nothing counts as delivered, nothing is
    dead-lettered, no attempt is charged; once ``allow``ed, every event arrives in order per key."""
    events = [(f"key-{k}", "t", {"n": n}) for n in range(4) for k in range(3)]
    refuse()
    with caplog.at_level(logging.WARNING, logger="outbox_relay.sinks"), \
            running(relay(dsn, server.url, "p:", max_attempts=2)):
        ids = publish(dsn, events, topic="orders")
        # A sink that ignored the error would count the events delivered instead of warning.
        wait_until(lambda: expected in caplog.text or pending(dsn) < len(ids), timeout=20,
                   message=f"a warning with {expected!r}")
        assert pending(dsn) == len(ids), "nothing counts as delivered while the server refuses"
        assert read_back(fields(server.url, "p:")) == []
        assert dead_letters(dsn, SINK) == {}
        assert all(n == 0 for key in {k for k, _t, _p in events} for _i, n, _e in parked_rows(dsn, key, SINK))
        allow()
        wait_until(lambda: settled(dsn), timeout=20, message="delivered once allowed")
    assert dead_letters(dsn, SINK) == {}
    assert firsts_per_key(read_back(fields(server.url, "p:"))) == per_key(events, ids)


def test_a_server_short_of_the_replicas_it_requires_holds_the_sink_and_nothing_counts_as_delivered(
        dsn: str, server: PrivateRedis, caplog: pytest.LogCaptureFixture) -> None:
    # The test that fails if the acknowledgement is not waited for or its error is ignored. The refusal is
    # min-replicas-to-write on a server with no replica: every write answers NOREPLICAS. (maxmemory 1 was
    # not one: under a loaded machine the server let some XADDs through, which the sink rightly counted.)
    admin = server.client()
    _held_then_delivered(dsn, server, lambda: admin.config_set("min-replicas-to-write", "1"),
                         lambda: admin.config_set("min-replicas-to-write", "0"), "NOREPLICAS", caplog)


def test_an_acl_that_denies_xadd_holds_the_sink(dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with private_redis(tmp_path / "redis") as server:
        admin = server.client()
        admin.acl_setuser("relay", enabled=True, passwords=[f"+{PASSWORD}"], keys=["*"],
                          commands=["+@all", "-xadd"])
        url = f"redis://relay:{PASSWORD}@127.0.0.1:{server.port}/0"
        events = [("k", "t", {"n": n}) for n in range(3)]
        with caplog.at_level(logging.WARNING), running(relay(dsn, url, "p:", max_attempts=2)):
            ids = publish(dsn, events, topic="orders")
            wait_until(lambda: "NOPERM" in caplog.text, timeout=20, message="a NOPERM warning")
            assert pending(dsn) == 3 and dead_letters(dsn, SINK) == {}
            admin.acl_setuser("relay", enabled=True, commands=["+xadd"])
            wait_until(lambda: settled(dsn), timeout=20, message="delivered once allowed")
        assert [i for i, _k, _s in read_back(fields(url, "p:"))] == ids
        assert PASSWORD not in caplog.text


def test_a_key_of_another_type_holds_the_sink(dsn: str, server: PrivateRedis,
                                              caplog: pytest.LogCaptureFixture) -> None:
    admin = server.client()
    _held_then_delivered(dsn, server, lambda: admin.set("p:orders", "not a stream"),
                         lambda: admin.delete("p:orders"), "WRONGTYPE", caplog)


def test_in_one_pipeline_an_error_reply_holds_only_its_own_event(dsn: str, server: PrivateRedis,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    # The test that fails if a pipeline's replies are not read one by one: three keys' events go to a stream,
    # the fourth key's to a key of another type, all in one wave (one read, one pipeline).
    admin = server.client()
    admin.set("p:refunds", "not a stream")
    with caplog.at_level(logging.WARNING), running(relay(dsn, server.url, "p:", max_attempts=2)):
        wait_until(lambda: settled(dsn), timeout=20, message="the sink registered")
        with psycopg.connect(dsn) as conn:
            published = Outbox().publish_many(conn, [
                {"key": f"key-{k}", "type": "t", "payload": {}, "topic": "refunds" if k == 3 else "orders"}
                for k in range(4)])
        ids = [p.id for p in published]
        wait_until(lambda: "WRONGTYPE" in caplog.text and pending(dsn) == 1, timeout=20,
                   message="the three other events delivered, the refund held")
        assert sorted(uuid.UUID(f[b"id"].decode()) for _, f in admin.xrange("p:orders")) == sorted(ids[:3])
        assert [n for _i, n, _e in parked_rows(dsn, "key-3", SINK)] == [0], "held, no attempt counted"
        admin.delete("p:refunds")
        wait_until(lambda: settled(dsn), timeout=20, message="the refund delivered once its stream can be")
    assert [uuid.UUID(f[b"id"].decode()) for _, f in admin.xrange("p:refunds")] == ids[3:]
    assert dead_letters(dsn, SINK) == {}


def test_a_paused_server_holds_the_sink_until_it_answers(dsn: str, server: PrivateRedis,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    events = [("k", "t", {"n": n}) for n in range(5)]
    with caplog.at_level(logging.WARNING), running(relay(dsn, server.url, "p:", redis_timeout_seconds=0.3,
                                                         max_attempts=2)):
        with server.paused():
            ids = publish(dsn, events, topic="orders")
            wait_until(lambda: "Timeout" in caplog.text or pending(dsn) < 5, timeout=20, message="a timeout warning")
            assert pending(dsn) == 5, "no reply, not delivered"
        wait_until(lambda: settled(dsn), timeout=20, message="delivered once it answers")
    assert dead_letters(dsn, SINK) == {}
    assert firsts_per_key(read_back(fields(server.url, "p:"))) == {"k": ids}


def test_a_restarted_server_keeps_what_was_acknowledged_and_delivery_resumes(
        dsn: str, server: PrivateRedis) -> None:
    first = [("k", "t", {"n": n}) for n in range(20)]
    second = [("k", "t", {"n": n}) for n in range(20, 40)]
    with running(relay(dsn, server.url, "p:")):
        ids = publish(dsn, first, topic="orders")
        wait_until(lambda: settled(dsn), timeout=20, message="the first half")
        server.kill()  # SIGKILL: appendfsync always kept every acknowledged entry
        ids += publish(dsn, second, topic="orders")
        server.start()
        wait_until(lambda: settled(dsn), timeout=20, message="the second half")
    assert firsts_per_key(read_back(fields(server.url, "p:"))) == {"k": ids}
    assert dead_letters(dsn, SINK) == {}


# -- credentials, TLS, settings -------------------------------------------------------------------


def test_a_wrong_password_holds_and_never_shows_and_a_password_file_works(
        dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    wrong = "wrong-Pass-1234"
    with private_redis(tmp_path / "redis", "--requirepass", PASSWORD) as server:
        url = f"redis://:{wrong}@127.0.0.1:{server.port}/0"
        with caplog.at_level(logging.DEBUG), running(relay(dsn, url, "p:", max_attempts=2)):
            [event_id] = publish(dsn, [("k", "t", {"n": 1})], topic="orders")
            wait_until(lambda: "WRONGPASS" in caplog.text or "invalid" in caplog.text, timeout=20,
                       message="an authentication warning")
            assert dead_letters(dsn, SINK) == {}
            rows = parked_rows(dsn, "k", SINK)
        assert wrong not in caplog.text and all(wrong not in (e or "") for _i, _n, e in rows)
        secret = tmp_path / "redis.password"
        secret.write_text(PASSWORD + "\n")
        plain = f"redis://127.0.0.1:{server.port}/0"
        with running(relay(dsn, plain, "p:", redis_password_file=secret)):
            wait_until(lambda: settled(dsn), timeout=20, message="delivered with the password file")
        back = read_back(fields(plain, "p:", redis_password_file=secret))
        assert [i for i, _k, _s in back] == [event_id]


def test_tls_with_the_servers_ca(dsn: str, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path, "redis")
    with private_redis(tmp_path / "redis", tls=(cert, key)) as server:
        assert server.url.startswith("rediss://")
        with running(relay(dsn, server.url, "p:", redis_ca_file=cert)):
            ids = publish(dsn, [("k", "t", {"n": n}) for n in range(3)], topic="orders")
            wait_until(lambda: settled(dsn), timeout=20, message="delivered over TLS")
        assert [i for i, _k, _s in read_back(fields(server.url, "p:", redis_ca_file=cert))] == ids
        with running(relay(dsn, server.url, "q:")):  # the system's CAs do not know it: held, not dead-lettered
            publish(dsn, [("k2", "t", {"n": 1})], topic="orders")
            wait_until(lambda: parked_rows(dsn, "k2", SINK), timeout=20, message="held")
            assert dead_letters(dsn, SINK) == {} and pending(dsn) == 1


@pytest.mark.parametrize(("values", "expected"), [
    ({"redis_url": "http://127.0.0.1:6379"}, "must start with redis://"),
    ({"redis_url": "redis://:pw-Secret-9@127.0.0.1:6379/x"}, "database number"),
    ({"redis_url": "redis://127.0.0.1:6379", "redis_ca_file": "/tmp/ca.pem"}, "need a rediss:// URL"),
    ({"redis_url": "rediss://h:6379", "redis_client_key": "/tmp/k.pem"}, "needs --redis-client-cert"),
    ({"redis_url": "redis://:pw-Secret-9@h:6379", "redis_password_file": "/etc/hostname"}, "password once"),
    ({"redis_url": "redis://h:6379", "redis_password_file": "/nonexistent/pw"}, "cannot read the Redis password"),
    ({"redis_url": "redis://h:6379", "redis_stream_prefix": "has space"}, "stream prefix"),
    ({"redis_url": "redis://h:6379", "redis_topics": "ok,not ok"}, "not a topic name"),
    ({"redis_url": "redis://h:6379", "redis_sink": "Bad Name"}, "sink name"),
    ({"redis_url": "redis://h:6379", "redis_maxlen": 0}, "redis_maxlen"),
])
def test_bad_settings_are_refused_naming_the_problem_never_the_password(values: dict[str, Any],
                                                                        expected: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_settings(dsn="postgresql://u@h/db", kafka=False, **values)
    assert expected in str(caught.value)
    assert "pw-Secret-9" not in str(caught.value)


def test_the_settings_turn_the_sink_on_and_run_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    from outbox_relay import cli

    settings = load_settings(dsn="postgresql://u@h/db", kafka=False, redis_url="redis://:pw-Secret-9@h:6379/2")
    assert settings.sinks == ["redis"] and "pw-Secret-9" not in repr(settings)
    sink = RedisStreamsSink("redis://:pw-Secret-9@h:6379/2")
    assert sink.endpoint == "redis://h:6379/2" and "pw-Secret-9" not in repr(sink)
    assert cli.main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--redis-url", "--redis-stream-prefix", "--redis-maxlen", "--redis-concurrency",
                   "--redis-password-file", "--redis-ca-file", "OUTBOX_REDIS_URL"):
        assert option in out, option
