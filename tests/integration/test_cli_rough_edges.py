"""The operator commands against a real database (issue 18 items 1 and 4): each names the database it
used on stderr while --json keeps stdout pure JSON, `keys show` says a key it has never seen is
unknown, `dead-letters list` pages, `status` shows this database's open transactions (the server's
only with --all-databases), and the backlog is a library call."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable

import psycopg
import pytest

from outbox_relay import cli, store
from tests.cli_helpers import run_cli
from tests.integration.relay_helpers import publish
from tests.servers import wait_until


def dead_letter(dsn: str, key: str, n: int) -> list[str]:
    """Publish ``n`` events of ``key`` and dead-letter them for sink kafka, one second apart in dead_at."""
    ids = publish(dsn, [(key, "t", {"i": i}) for i in range(n)])
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i, event_id in enumerate(ids):
            conn.execute(
                "INSERT INTO outbox.dead_letters (sink, event_id, bucket, xid, seq, partition_key, attempts, "
                "last_error, dead_at) SELECT 'kafka', id, bucket, xid, seq, partition_key, 3, 'boom', "
                "now() - make_interval(secs => %s) FROM outbox.events WHERE id = %s", (n - i, event_id))
    return [str(i) for i in reversed(ids)]  # newest dead_at first


@pytest.mark.parametrize("argv", [["status"], ["lag"], ["sinks", "list"], ["dead-letters", "list"],
                                  ["keys", "show", "k"]])
def test_each_command_names_its_database_once_and_json_stays_json(dsn: str, capsys: pytest.CaptureFixture[str],
                                                                  argv: list[str]) -> None:
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    code, out, err = run_cli(capsys, *argv, "--dsn", dsn, "--json")
    assert code == cli.EXIT_OK, err
    json.loads(out)  # stdout is JSON and nothing else
    assert err.count("outbox-relay: using database ") == 1 and f"database {dbname} on " in err, err


def test_migrate_names_its_database(database_factory: Callable[..., str], capsys: pytest.CaptureFixture[str]) -> None:
    fresh = database_factory()
    code, out, err = run_cli(capsys, "migrate", "--dsn", fresh)
    assert code == cli.EXIT_OK and "applied" in out, err
    assert err.count("outbox-relay: using database ") == 1, err


def test_keys_show_json_without_sinks_is_json(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "keys", "show", "order-1", "--dsn", dsn, "--json")
    assert code == cli.EXIT_OK, err
    assert json.loads(out) == {"key": "order-1", "bucket": None, "max_attempts": 10, "sinks": []}, out


def test_keys_show_says_a_key_never_published_is_unknown(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.register_sink(conn, "kafka", "kafka")
    publish(dsn, [("order-1", "t", {})])

    code, out, err = run_cli(capsys, "keys", "show", "order-l", "--dsn", dsn, "--json")  # a typo: l for 1
    assert code == cli.EXIT_OK, err
    [sink] = json.loads(out)["sinks"]
    assert sink["state"] == "unknown" and sink["stored"] == 0, sink
    _, out, _ = run_cli(capsys, "keys", "show", "order-l", "--dsn", dsn)
    assert "unknown" in out and "flowing" not in out, out

    _, out, _ = run_cli(capsys, "keys", "show", "order-1", "--dsn", dsn, "--json")
    [sink] = json.loads(out)["sinks"]
    assert sink["state"] == "flowing" and sink["stored"] == 1 and sink["unread"] == 1, sink


def test_dead_letters_list_pages(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.register_sink(conn, "kafka", "kafka")
    newest_first = dead_letter(dsn, "k", 5)

    code, out, err = run_cli(capsys, "dead-letters", "list", "--dsn", dsn, "--limit", "2", "--json")
    assert code == cli.EXIT_OK
    page = [d["event_id"] for d in json.loads(out)]
    assert page == newest_first[:2], page
    assert f"--after {newest_first[1]}" in err, err  # says there are more, and how to get them
    seen = page
    while True:
        code, out, err = run_cli(capsys, "dead-letters", "list", "--dsn", dsn, "--limit", "2", "--after", seen[-1],
                             "--json")
        assert code == cli.EXIT_OK, err
        page = [d["event_id"] for d in json.loads(out)]
        seen += page
        if "--after" not in err:
            break
    assert seen == newest_first, seen

    code, out, _ = run_cli(capsys, "dead-letters", "list", "--dsn", dsn, "--limit", "4")
    assert "more: outbox-relay dead-letters list" in out and f"--after {newest_first[3]}" in out, out

    code, _, err = run_cli(capsys, "dead-letters", "list", "--dsn", dsn, "--after", str(uuid.uuid4()))
    assert code == cli.EXIT_ERROR and "no dead letter" in err, err


def test_dead_letter_actions_and_sink_actions_answer_json(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.register_sink(conn, "kafka", "kafka")
        store.register_sink(conn, "old", "kafka")
    ids = dead_letter(dsn, "k", 2)
    code, out, err = run_cli(capsys, "dead-letters", "retry", "--dsn", dsn, "--sink", "kafka", "--event", ids[0],
                             "--json")
    assert code == cli.EXIT_OK, err
    assert json.loads(out) == {"action": "retry", "sink": "kafka", "count": 1, "event_ids": [ids[0]]}
    code, out, err = run_cli(capsys, "dead-letters", "discard", "--dsn", dsn, "--sink", "kafka", "--all", "--json")
    assert json.loads(out) == {"action": "discard", "sink": "kafka", "count": 1, "event_ids": [ids[1]]}
    code, out, err = run_cli(capsys, "sinks", "drop", "old", "--dsn", dsn, "--json")
    assert code == cli.EXIT_OK, err
    dropped = json.loads(out)
    assert dropped["action"] == "drop" and dropped["sink"] == "old" and dropped["dropped"] is True, dropped
    code, out, err = run_cli(capsys, "sinks", "recreate", "old", "--dsn", dsn, "--json")
    assert code == cli.EXIT_OK and json.loads(out)["action"] == "recreate", err


def test_status_shows_this_databases_transactions_unless_asked_for_all(
        dsn: str, database_factory: Callable[..., str], capsys: pytest.CaptureFixture[str]) -> None:
    elsewhere = database_factory()
    with psycopg.connect(elsewhere) as other:
        other.execute("CREATE TEMP TABLE scratch (v int)")
        other.execute("INSERT INTO scratch VALUES (1)")  # an open writing transaction in another database
        pid = other.info.backend_pid

        _, out, _ = run_cli(capsys, "status", "--dsn", dsn, "--json")
        assert json.loads(out)["oldest_open_transaction"] == [], out

        def server_wide() -> bool:
            _, text, _ = run_cli(capsys, "status", "--dsn", dsn, "--json", "--all-databases")
            holders = json.loads(text)["oldest_open_transaction"]
            return bool(holders) and holders[0]["pid"] == pid

        wait_until(server_wide, 10, 0.2, "status --all-databases to name the other database's transaction")


def test_backlog_from_python(dsn: str) -> None:
    from outbox_relay.backlog import SinkBacklog, backlog

    with psycopg.connect(dsn, autocommit=True) as conn:
        store.register_sink(conn, "kafka", "kafka")
        store.register_sink(conn, "totals", "projection")
    publish(dsn, [("k1", "t", {}), ("k2", "t", {})])
    with psycopg.connect(dsn, autocommit=True) as conn:
        everything = backlog(conn)
        assert [b.sink for b in everything] == ["kafka", "totals"]
        [kafka] = backlog(conn, sink="kafka")
    assert isinstance(kafka, SinkBacklog) and kafka.pending == 2 and kafka.kind == "kafka", kafka
    assert kafka.dead_letters == 0 and kafka.oldest_pending_seconds is not None and kafka.oldest_pending_seconds >= 0


@pytest.mark.parametrize("json_output", [False, True], ids=["table", "json"])
def test_a_reader_that_stops_early_is_no_error(dsn: str, json_output: bool) -> None:
    """`outbox-relay dead-letters list | head -1`: the reader closes the pipe while output is still being
    written. That is the reader's choice, not a bug of the command: no "unexpected error", exit 0."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.register_sink(conn, "kafka", "kafka")
        conn.execute("WITH e AS (INSERT INTO outbox.events (partition_key, type, topic, payload) "
                     "SELECT 'k' || g, 't', 'orders', '{}' FROM generate_series(1, 3000) AS g "
                     "RETURNING bucket, xid, seq, partition_key, id) "
                     "INSERT INTO outbox.dead_letters (sink, event_id, bucket, xid, seq, partition_key, attempts, "
                     "last_error) SELECT 'kafka', id, bucket, xid, seq, partition_key, 3, 'boom' FROM e")
    argv = [sys.executable, "-m", "outbox_relay.cli", "dead-letters", "list", "--limit", "3000", "--dsn", dsn]
    with subprocess.Popen([*argv, *(["--json"] if json_output else [])], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, stdin=subprocess.DEVNULL) as command:
        assert command.stdout is not None and command.stderr is not None
        assert command.stdout.readline()  # the first line, more than a pipe's buffer still to come
        command.stdout.close()
        err = command.stderr.read().decode()
        code = command.wait(60)
    assert code == cli.EXIT_OK, err
    assert "error" not in err and "Broken pipe" not in err, err
