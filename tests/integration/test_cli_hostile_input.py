"""Operator commands against what producers and operators get wrong: producer-written strings with
terminal escapes are printed escaped (tables and plain text; --json stays exact), an unknown sink is
refused with exit 2 by every command that takes --sink."""

from __future__ import annotations

import json

import psycopg
import pytest

from outbox_relay import cli, store
from tests.cli_helpers import run_cli

# ESC (a colour and a window title), BEL, CR (overwrites the line), a C1 CSI, DEL, and a right-to-left override.
HOSTILE_KEY = "k\x1b[31mred\x07\rX\x9b2J\x7f\u202eevil"
HOSTILE_TYPE = "order.\x1b]0;pwned\x07placed"
HOSTILE_ERROR = "broker said\x1b[2J no\u2066"
RAW = ("\x1b", "\x07", "\r", "\x9b", "\x7f", "\u202e", "\u2066")


def dead_letter(dsn: str, sink: str, key: str, type_: str, error: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.register_sink(conn, sink, "kafka")
        store.heartbeat(conn, "relay-\x1b[1m", "alive", [sink], {"listening": True})
        # A plain SQL producer's insert (what other languages do): the same strings reach the table.
        row = conn.execute("INSERT INTO outbox.events (partition_key, type, topic, payload) "
                           "VALUES (%s, %s, 'orders', '{}') RETURNING bucket, xid, seq, partition_key, id",
                           (key, type_)).fetchone()
        assert row is not None
        b, x, s, k, i = row
        conn.execute("INSERT INTO outbox.dead_letters (sink, event_id, bucket, xid, seq, partition_key, attempts, "
                     "last_error) VALUES (%s, %s, %s, %s, %s, %s, 3, %s)", (sink, i, b, x, s, k, error))


def test_producer_strings_reach_the_terminal_escaped(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    dead_letter(dsn, "kafka", HOSTILE_KEY, HOSTILE_TYPE, HOSTILE_ERROR)
    outputs = {
        "status": run_cli(capsys, "status", "--dsn", dsn),
        "dead-letters list": run_cli(capsys, "dead-letters", "list", "--dsn", dsn),
        "keys show": run_cli(capsys, "keys", "show", "--dsn", dsn, HOSTILE_KEY),
    }
    for command, (code, out, err) in outputs.items():
        assert code == cli.EXIT_OK, (command, err)
        assert not any(c in out + err for c in RAW), (command, out)
        assert "\\x1b" in out, (command, out)  # shown, not dropped
    assert "\\x1b[31mred\\x07\\x0dX\\x9b2J\\x7f\\u202eevil" in outputs["dead-letters list"][1]
    assert "order.\\x1b]0;pwned\\x07placed" in outputs["keys show"][1]
    assert "broker said\\x1b[2J no\\u2066" in outputs["keys show"][1]


def test_json_output_stays_exact(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    dead_letter(dsn, "kafka", HOSTILE_KEY, HOSTILE_TYPE, HOSTILE_ERROR)
    code, out, _ = run_cli(capsys, "dead-letters", "list", "--dsn", dsn, "--json")
    assert code == cli.EXIT_OK
    [row] = json.loads(out)
    assert (row["partition_key"], row["type"], row["last_error"]) == (HOSTILE_KEY, HOSTILE_TYPE, HOSTILE_ERROR)
    code, out, _ = run_cli(capsys, "keys", "show", "--dsn", dsn, HOSTILE_KEY, "--json")
    assert code == cli.EXIT_OK and json.loads(out)["key"] == HOSTILE_KEY


@pytest.mark.parametrize("action", [["list"], ["retry", "--all"], ["discard", "--all"]], ids=" ".join)
def test_dead_letters_refuses_an_unknown_sink(dsn: str, capsys: pytest.CaptureFixture[str], action: list[str]) -> None:
    dead_letter(dsn, "kafka", "k", "t", "boom")
    code, out, err = run_cli(capsys, "dead-letters", *action, "--sink", "no-such-sink", "--dsn", dsn)
    assert code == cli.EXIT_ERROR, (out, err)
    assert "no sink named 'no-such-sink'" in err and out == "", (out, err)
    # The known sink still works, and the refusal touched nothing.
    code, out, err = run_cli(capsys, "dead-letters", "list", "--sink", "kafka", "--dsn", dsn, "--json")
    assert code == cli.EXIT_OK and len(json.loads(out)) == 1, err
