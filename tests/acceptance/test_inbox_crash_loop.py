"""A handler that kills its process (os._exit: no exception, like a segfault or the OOM killer), with
``outbox-relay inbox run`` restarted after each death as a supervisor would: the message's attempts
survive the restarts, it lands in the dead letters after ``--max-attempts`` and its partition goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg

from outbox_relay.inbox import migrate_inbox
from outbox_relay.inbox.admin import list_dead_letters, request_retry, show_dead_letter
from outbox_relay.inbox.store import CRASH_ERROR
from tests.integration.inbox_app import setup
from tests.integration.inbox_helpers import effects, produce_events, scalar
from tests.servers import wait_until

ROOT = Path(__file__).resolve().parents[2]
MAX_ATTEMPTS = 2


class Supervisor:
    """Runs one consumer process and starts a new one whenever it dies (counted in ``deaths``)."""

    def __init__(self, tmp: Path, dsn: str, bootstrap: str, topic: str, member: str | None = None) -> None:
        self.tmp, self.dsn, self.bootstrap, self.topic = tmp, dsn, bootstrap, topic
        self.member = member  # --member-id of every process (None: the default, host-pid: new each time)
        self.calls = tmp / "exit-calls"  # one line per call of the handler on an {"exit": true} message
        self.deaths = 0
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, "OUTBOX_INBOX_DSN": self.dsn, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
               "INBOX_APP_EXITS": str(self.calls)}
        with (self.tmp / "consumer.log").open("ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "outbox_relay.cli", "inbox", "run",
                 "--handler", "tests.integration.inbox_app:handle", "--topic", self.topic,
                 "--bootstrap-servers", self.bootstrap, "--lease-seconds", "1", "--verify-seconds", "3",
                 "--max-attempts", str(MAX_ATTEMPTS), "--backoff-base-seconds", "0.05",
                 "--backoff-max-seconds", "0.1", *(["--member-id", self.member] if self.member else [])],
                env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def tend(self) -> None:
        """Restart the consumer if it died (with the handler's exit status, not a start-up error)."""
        code = self.proc.poll()
        if code is not None:
            assert code == 17, f"the consumer exited with {code}: {self.log()[-2000:]}"
            self.deaths += 1
            self.proc = self._start()

    def until(self, condition: Callable[[], bool], timeout: float, message: str) -> None:
        def check() -> bool:
            self.tend()
            return condition()
        wait_until(check, timeout, 0.1, message)

    def log(self) -> str:
        return (self.tmp / "consumer.log").read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        finally:
            self.proc.kill()


def test_a_message_that_kills_the_consumer_is_dead_lettered_after_max_attempts_across_restarts(
        database_factory: Callable[..., str], kafka_bootstrap: str, kafka_topic: str, tmp_path: Path) -> None:
    dsn = database_factory()
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate_inbox(conn)
        setup(conn)
    before = produce_events(kafka_bootstrap, kafka_topic, [("k", 0, {"n": 0}), ("o", 1, {"n": 1})])
    [killer] = produce_events(kafka_bootstrap, kafka_topic, [("k", 0, {"exit": True})])
    after = produce_events(kafka_bootstrap, kafka_topic, [("k", 0, {"n": 2}), ("k", 0, {"n": 3}), ("o", 1, {"n": 4})])
    supervisor = Supervisor(tmp_path, dsn, kafka_bootstrap, kafka_topic)
    try:
        supervisor.until(lambda: scalar(dsn, "SELECT count(*) FROM outbox_inbox.dead_letters") == 1, 120,
                         "the killer message in the dead letters")
        supervisor.until(lambda: len(effects(dsn)) == 5, 30, "its partition went on")
        with psycopg.connect(dsn, autocommit=True) as conn:
            [dead] = list_dead_letters(conn, "inbox")
            assert (dead["message_id"], dead["attempts"]) == (killer, MAX_ATTEMPTS)
            assert show_dead_letter(conn, "inbox", dead["id"])["error"] == CRASH_ERROR
        calls = supervisor.calls.read_text().split()
        assert set(calls) == {killer}
        # One death in a normal batch, then the recorded attempts alone; a batch of the ramp (1, 2, 4, ...)
        # after the first careful message may meet it once more before it is alone.
        assert MAX_ATTEMPTS + 1 <= len(calls) == supervisor.deaths <= MAX_ATTEMPTS + 2, supervisor.deaths
        assert scalar(dsn, "SELECT count(*) FROM outbox_inbox.positions WHERE attempts > 0") == 0

        # A retried dead letter that kills the consumer again uses its request up: the next process does
        # not retry it (no crash loop through the retry either); the attempt counts with the crash's error.
        deaths = supervisor.deaths
        with psycopg.connect(dsn, autocommit=True) as conn:
            request_retry(conn, "inbox", [dead["id"]])
        supervisor.until(lambda: supervisor.deaths == deaths + 1, 30, "the retried dead letter killed it")
        with psycopg.connect(dsn, autocommit=True) as conn:
            again = show_dead_letter(conn, "inbox", dead["id"])
            assert (again["attempts"], again["error"], again["retry_requested_at"]) == (MAX_ATTEMPTS + 1,
                                                                                       CRASH_ERROR, None)
            more = produce_events(kafka_bootstrap, kafka_topic, [("k", 0, {"n": 5})])
            supervisor.until(lambda: len(effects(dsn)) == 6, 30, "the restarted consumer goes on")
            time.sleep(2)  # more than a dead-letter check (1 s): it is not retried on its own
            supervisor.tend()
            assert supervisor.deaths == deaths + 1

            # Cured and asked again: applied once, late (after the messages that followed it).
            conn.execute("INSERT INTO inbox_app.cured VALUES (1)")
            request_retry(conn, "inbox", [dead["id"]])
            supervisor.until(lambda: scalar(dsn, "SELECT count(*) FROM outbox_inbox.dead_letters") == 0, 30,
                             "the cured dead letter applied")
            assert conn.execute("SELECT late FROM inbox_app.effects WHERE message_id = %s",
                                (killer,)).fetchall() == [(True,)]
    finally:
        supervisor.stop()
    assert Counter(e[0] for e in effects(dsn)) == Counter(before + after + more + [killer]), "each exactly once"
