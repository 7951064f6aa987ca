"""``outbox-relay inbox`` as a user runs it: migrate, run (SIGKILL and restart, SIGTERM), status, dead-letters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg

from tests.integration.inbox_app import setup
from tests.integration.inbox_helpers import effects, produce_events, scalar
from tests.servers import wait_until

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "outbox_relay.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert not check or done.returncode == 0, done.stderr
    return done


def start(tmp: Path, member: str, dsn: str, bootstrap: str, topic: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OUTBOX_INBOX_DSN": dsn, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with (tmp / f"{member}.log").open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox_relay.cli", "inbox", "run",
             "--handler", "tests.integration.inbox_app:handle", "--topic", topic,
             "--bootstrap-servers", bootstrap, "--member-id", member, "--lease-seconds", "2",
             "--verify-seconds", "3", "--max-attempts", "2", "--backoff-base-seconds", "0.05"],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def test_a_consumer_killed_mid_stream_and_restarted_applies_everything_once(
        database_factory: Callable[..., str], kafka_bootstrap: str, kafka_topic: str, tmp_path: Path) -> None:
    dsn = database_factory()
    assert "applied 0001_initial" in cli("inbox", "migrate", "--dsn", dsn).stdout
    with psycopg.connect(dsn, autocommit=True) as conn:
        setup(conn)
    ids = produce_events(kafka_bootstrap, kafka_topic, [(f"k{i}", i % 4, {"n": i, "sleep": 0.01}) for i in range(300)])
    first = start(tmp_path, "first", dsn, kafka_bootstrap, kafka_topic)
    try:
        wait_until(lambda: len(effects(dsn)) >= 60, 60, 0.05, "some applied before the kill")
        first.send_signal(signal.SIGKILL)  # mid-transaction, most likely: the handler sleeps inside it
        first.wait(10)
    finally:
        first.kill()
        first.wait(30)
    assert len(effects(dsn)) < 300
    second = start(tmp_path, "second", dsn, kafka_bootstrap, kafka_topic)
    try:
        wait_until(lambda: len(effects(dsn)) >= 300, 90, 0.1, "all 300 applied after the restart")
        # The relay's redelivery of some, and one poison message.
        produce_events(kafka_bootstrap, kafka_topic, [(f"k{i}", i % 4, {"n": i}) for i in range(20)], ids=ids[:20])
        [poison] = produce_events(kafka_bootstrap, kafka_topic, [("p", 0, {"poison": True})])
        wait_until(lambda: scalar(dsn, "SELECT count(*) FROM outbox_inbox.dead_letters") == 1, 30, 0.1)
        wait_until(lambda: scalar(dsn, "SELECT sum(duplicates) FROM outbox_inbox.positions") == 20, 30, 0.1)

        status = json.loads(cli("inbox", "status", "--dsn", dsn, "--json").stdout)
        assert sum(p["applied"] for p in status) == 300 and {p["owner"] for p in status} == {"second"}
        [dead] = json.loads(cli("inbox", "dead-letters", "list", "--dsn", dsn, "--json").stdout)
        assert dead["message_id"] == poison
        shown = json.loads(cli("inbox", "dead-letters", "show", "--dsn", dsn, "--id", str(dead["id"]), "--json").stdout)
        assert shown["headers"]["ce_id"] == poison and json.loads(shown["value"]) == {"poison": True}
        refused = cli("inbox", "dead-letters", "retry", "--dsn", dsn, check=False)
        assert refused.returncode == 2 and "needs --id or --all" in refused.stderr
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO inbox_app.cured VALUES (1)")
        assert "1 dead letters asked to retry" in cli("inbox", "dead-letters", "retry", "--dsn", dsn, "--all").stdout
        wait_until(lambda: scalar(dsn, "SELECT count(*) FROM outbox_inbox.dead_letters") == 0, 30, 0.1)

        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    finally:
        second.kill()
        second.wait(30)
    assert Counter(e[0] for e in effects(dsn)) == Counter([*ids, poison]), "each event's effect exactly once"
    assert scalar(dsn, "SELECT count(*) FROM outbox_inbox.positions WHERE owner IS NOT NULL") == 0, "leases released"


def test_bad_input_is_named(database_factory: Callable[..., str]) -> None:
    dsn = database_factory()
    done = cli("inbox", "run", "--dsn", dsn, "--topic", "t", "--bootstrap-servers", "127.0.0.1:1",
               "--handler", "nosuchmodule:x", check=False)
    assert done.returncode == 2 and "--handler nosuchmodule:x: no module named 'nosuchmodule'" in done.stderr
    done = cli("inbox", "run", "--dsn", dsn, "--topic", "bad topic!", "--bootstrap-servers", "127.0.0.1:1",
               "--handler", "json:loads", check=False)
    assert done.returncode == 2 and "is not a Kafka topic name" in done.stderr and "--topic," in done.stderr
    done = cli("inbox", "run", "--dsn", dsn, "--topic", "t", "--bootstrap-servers", "127.0.0.1:1",
               "--handler", "json:loads", check=False)
    assert done.returncode == 2 and "inbox tables are missing" in done.stderr
    done = cli("inbox", "run", "--dsn", "postgresql://nobody:secret@127.0.0.1:1/x", "--topic", "t",
               "--bootstrap-servers", "127.0.0.1:1", "--handler", "json:loads", check=False)
    assert done.returncode == 2 and "cannot connect to" in done.stderr and "secret" not in done.stderr
    done = cli("inbox", "dead-letters", "show", "--dsn", dsn, "--id", "1", check=False)
    assert done.returncode == 2 and "inbox tables are missing" in done.stderr
