"""The inbox's attempts kept in PostgreSQL (a crash or a restart counts), and retried dead letters
(applied once, late). The process-killing handler itself: tests/acceptance/test_inbox_crash_loop.py."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outbox_relay.inbox import InboxMessage
from outbox_relay.inbox.admin import list_dead_letters, request_retry, show_dead_letter
from outbox_relay.inbox.store import retry_one_dead_letter
from tests.integration import inbox_app
from tests.integration.inbox_helpers import consumer_thread, effects, inbox_database, produce_events, scalar, settings
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


@pytest.fixture
def inbox_dsn(database_factory: Callable[..., str]) -> str:
    return inbox_database(database_factory)


def counting(calls: Counter[str]) -> Callable[[InboxMessage, psycopg.Connection[Any]], None]:
    def handler(message: InboxMessage, conn: psycopg.Connection[Any]) -> None:
        calls[message.id] += 1
        inbox_app.handle(message, conn)
    return handler


def test_a_head_message_whose_recorded_attempts_are_spent_is_dead_lettered_without_a_call(
        inbox_dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    """What a process that died during the last allowed attempt leaves: the next holder gives up at once."""
    crasher, after = produce_events(kafka_bootstrap, kafka_topic, [("k", 0, {"n": 0}), ("k", 0, {"n": 1})])
    with psycopg.connect(inbox_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox_inbox.positions (consumer, topic, partition, owner, fence, lease_until, "
                     "attempt_message_id, attempts, last_error) "
                     "VALUES ('inbox', %s, 0, 'died', 7, now() - interval '1 minute', %s, 3, 'it stopped')",
                     (kafka_topic, crasher))
    calls: Counter[str] = Counter()
    with consumer_thread(settings(inbox_dsn, kafka_bootstrap, kafka_topic, max_attempts=3), counting(calls)) as c:
        wait_until(lambda: c.stats.dead == 1 and c.stats.applied == 1, 30, 0.1, "dead-lettered, the next applied")
        assert c.stats.lapses == 1
    assert calls == Counter({after: 1}), "the spent message's handler is not called again"
    with psycopg.connect(inbox_dsn, autocommit=True) as conn:
        [dead] = list_dead_letters(conn, "inbox")
        assert (dead["message_id"], dead["attempts"], dead["error"]) == (crasher, 3, "it stopped")
    assert scalar(inbox_dsn, "SELECT attempts = 0 AND attempt_message_id IS NULL FROM outbox_inbox.positions "
                  "WHERE partition = 0"), "the record ends with the dead letter"


def test_attempts_survive_a_clean_restart(inbox_dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    [poison] = produce_events(kafka_bootstrap, kafka_topic, [("k", 0, {"poison": True})])
    calls: Counter[str] = Counter()

    def slow_second(message: InboxMessage, conn: psycopg.Connection[Any]) -> None:
        if calls[message.id] == 1:
            time.sleep(0.5)  # the test stops the consumer during attempt 2: it ends after it
        counting(calls)(message, conn)

    s = settings(inbox_dsn, kafka_bootstrap, kafka_topic, max_attempts=3)
    with consumer_thread(s, slow_second):
        # attempt 1 in a batch (not recorded); attempt 2 alone, recorded before it is made
        wait_until(lambda: scalar(inbox_dsn, "SELECT attempts FROM outbox_inbox.positions WHERE partition = 0") == 2,
                   30, 0.02)
    assert calls[poison] == 2
    assert "ValueError: poison message" in scalar(
        inbox_dsn, "SELECT last_error FROM outbox_inbox.positions WHERE partition = 0"), "the real error, kept"
    with consumer_thread(s, counting(calls)) as c:
        wait_until(lambda: c.stats.dead == 1, 30, 0.1)
    assert calls[poison] == 3, "the restart went on from the stored count, not from 0"
    with psycopg.connect(inbox_dsn, autocommit=True) as conn:
        [dead] = list_dead_letters(conn, "inbox")
        assert dead["attempts"] == 3 and "ValueError: poison message" in dead["error"]


def test_a_dead_letter_without_retries_does_not_skip_the_messages_fetched_with_it(
        inbox_dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    events = [("k", 0, {"n": i, "poison": i == 3}) for i in range(10)]
    ids = produce_events(kafka_bootstrap, kafka_topic, events)
    with consumer_thread(settings(inbox_dsn, kafka_bootstrap, kafka_topic, max_attempts=1)) as c:
        wait_until(lambda: c.stats.dead == 1 and c.stats.applied == 9, 30, 0.1, "9 applied, 1 dead")
    assert [e[0] for e in effects(inbox_dsn)] == ids[:3] + ids[4:]


def test_a_retried_dead_letter_is_applied_once_late_and_a_second_copy_is_a_duplicate(inbox_dsn: str) -> None:
    with psycopg.connect(inbox_dsn, autocommit=True) as conn:
        # The same event dead-lettered twice (a redelivery failed too), asked to retry together.
        conn.execute("INSERT INTO outbox_inbox.dead_letters (consumer, message_id, topic, partition, \"offset\", "
                     "value, header_names, header_values, attempts, error) VALUES "
                     "('inbox', 'e-1', 't', 0, 4, '{}', '{ce_id}', ARRAY['e-1'::bytea], 5, 'boom'), "
                     "('inbox', 'e-1', 't', 0, 9, '{}', '{ce_id}', ARRAY['e-1'::bytea], 5, 'boom')")
        first, second = sorted(r["id"] for r in list_dead_letters(conn, "inbox"))
        assert request_retry(conn, "inbox", None) == [first, second]
    with psycopg.connect(inbox_dsn) as conn:
        assert retry_one_dead_letter(conn, "inbox", inbox_app.handle) == (first, "applied")
        assert retry_one_dead_letter(conn, "inbox", inbox_app.handle) == (second, "duplicate")
        assert retry_one_dead_letter(conn, "inbox", inbox_app.handle) is None
    assert scalar(inbox_dsn, "SELECT array_agg((message_id, late)::text) FROM inbox_app.effects") == ["(e-1,t)"]
    assert scalar(inbox_dsn, "SELECT count(*) FROM outbox_inbox.dead_letters") == 0
    assert scalar(inbox_dsn, "SELECT count(*) FROM outbox_inbox.messages WHERE message_id = 'e-1'") == 1


def test_a_retried_dead_letter_that_fails_again_stays_with_its_error_and_is_not_retried_on_its_own(
        inbox_dsn: str) -> None:
    with psycopg.connect(inbox_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox_inbox.dead_letters (consumer, message_id, topic, partition, \"offset\", "
                     "value, header_names, header_values, attempts, error) VALUES "
                     "('inbox', 'p-1', 't', 0, 4, '{\"poison\": true}', '{ce_id}', ARRAY['p-1'::bytea], 5, 'boom')")
        [ident] = request_retry(conn, "inbox", None)
    with psycopg.connect(inbox_dsn) as conn:
        ident_again, error = retry_one_dead_letter(conn, "inbox", inbox_app.handle) or (0, "")
        assert ident_again == ident and "ValueError: poison message p-1" in error
        assert retry_one_dead_letter(conn, "inbox", inbox_app.handle) is None, "its request was used up"
    with psycopg.connect(inbox_dsn, autocommit=True) as conn:
        row = show_dead_letter(conn, "inbox", ident)
    assert (row["attempts"], row["retry_requested_at"]) == (6, None) and "poison message" in row["error"]
    assert effects(inbox_dsn) == [] and scalar(inbox_dsn, "SELECT count(*) FROM outbox_inbox.messages") == 0
