"""What a running relay says in its log (issue 25, finding 7): one INFO line per interval with what each sink
delivered and retried, a WARNING per failed attempt past the first few (rate-limited), and nothing that
reads like an incident for an operator's routine action."""

from __future__ import annotations

import logging
import threading
import uuid

import psycopg
import pytest

from outbox_relay import admin
from outbox_relay.compose import build_worker
from outbox_relay.sinks import Delivered, Retry, SinkEvent
from tests.integration.relay_helpers import dead_letters, make_settings, publish, running
from tests.servers import wait_until


class Flaky:
    """Fails each event of a ``bad`` payload ``fails`` times, then delivers it."""

    name = "flaky"
    kind = "flaky"

    def __init__(self, fails: int) -> None:
        self.fails = fails
        self.tries: dict[uuid.UUID, int] = {}
        self.delivered: set[uuid.UUID] = set()
        self.lock = threading.Lock()

    def deliver(self, event: SinkEvent) -> Delivered | Retry:
        with self.lock:
            n = self.tries[event.id] = self.tries.get(event.id, 0) + 1
            if '"bad"' in event.payload_json and n <= self.fails:
                return Retry(f"downstream said no ({n})", 0.01)
            self.delivered.add(event.id)
        return Delivered()


def messages(caplog: pytest.LogCaptureFixture, logger: str, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == level]


def test_a_relay_logs_what_it_delivered_and_warns_of_attempts_that_keep_failing(
        dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="outbox_relay")
    sink = Flaky(fails=5)
    worker = build_worker(make_settings(dsn, "w1", activity_log_seconds=0.3, max_attempts=10), [sink])
    with running(worker):
        ids = publish(dsn, [(f"k{i}", "t", {"n": i}) for i in range(20)]
                      + [(f"bad{i}", "t", {"bad": True}) for i in range(3)])
        wait_until(lambda: sink.delivered >= set(ids), timeout=30, message="every event delivered")
        wait_until(lambda: any("delivered" in m for m in messages(caplog, "outbox_relay.activity", logging.INFO)),
                   timeout=10, message="an activity line")
    lines = messages(caplog, "outbox_relay.activity", logging.INFO)
    delivered = sum(int(m.split("flaky: delivered ")[1].split(",")[0].split(";")[0]) for m in lines)
    assert delivered == len(ids), lines
    assert any("failed attempts (retrying)" in m for m in lines), lines
    warnings = messages(caplog, "outbox_relay.activity", logging.WARNING)
    # 3 events x attempts 3, 4, 5 failed past the first two: 9 candidates, at most one line per 10 s per sink.
    assert 1 <= len(warnings) <= 2, warnings
    assert "failed, attempt 3 of 10: downstream said no (3); it is retried" in warnings[0], warnings
    assert not messages(caplog, "outbox_relay.relay", logging.WARNING), "a retried event is no incident"


def test_an_operators_skip_is_logged_as_what_it_is_not_as_a_fenced_out_warning(
        dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="outbox_relay")
    sink = Flaky(fails=1000)
    worker = build_worker(make_settings(dsn, "w1", backoff_base_seconds=0.05, backoff_max_seconds=0.05), [sink])
    with running(worker):
        [bad, after] = publish(dsn, [("k", "t", {"bad": True}), ("k", "t", {"n": 2})])
        wait_until(lambda: sink.tries.get(bad, 0) >= 2, timeout=30, message="the head retried")
        with psycopg.connect(dsn, autocommit=True) as conn:
            admin.skip_key(conn, "k", "flaky")
        wait_until(lambda: after in sink.delivered, timeout=30, message="the key moved on")
    assert bad in dead_letters(dsn, "flaky")
    relay_warnings = messages(caplog, "outbox_relay.relay", logging.WARNING)
    assert not [m for m in relay_warnings if "fenced out" in m or "lost the lease" in m], relay_warnings
    infos = messages(caplog, "outbox_relay.relay", logging.INFO)
    assert any("an operator's action" in m and "keys skip" in m for m in infos), infos
