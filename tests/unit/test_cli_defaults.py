"""No silent defaults and a CLI that says what it does (issue 18 items 1 and 4), without a database:
a DSN is required, Kafka without bootstrap servers is refused, `--help` shows every default and every
action, tables fit the terminal, and the database a command uses is described without its password."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox_relay import cli
from outbox_relay.cli import common, output
from outbox_relay.dsn import describe
from outbox_relay.errors import ConfigurationError
from outbox_relay.settings import RelaySettings, flag, load_settings
from tests.cli_helpers import run_cli

UNREACHABLE = "postgresql://relay:Unre4chable-pw@127.0.0.1:1/app"  # nothing listens on port 1


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No OUTBOX_* or PG* from the caller's environment. (conftest puts the root logger back.)"""
    for name in list(os.environ):
        if name.startswith(("OUTBOX_", "PG")):
            monkeypatch.delenv(name)
    yield


# -- a DSN is required --------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["migrate"], ["status"], ["status", "--json"], ["lag"], ["sinks", "list"], ["dead-letters", "list"],
    ["keys", "show", "k"], ["run", "--no-kafka"], ["rebuild", "totals", "--projections", "app.models"],
    ["replay", "--topic", "orders", "--kafka-bootstrap-servers", "127.0.0.1:1"],
])
def test_every_database_command_needs_a_dsn(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == cli.EXIT_ERROR, (code, err)
    assert out == "" and err.count("\n") == 1, err
    assert "--dsn" in err and "OUTBOX_DSN" in err and "postgres" in err.lower(), err


def test_settings_have_no_default_dsn() -> None:
    with pytest.raises(ConfigurationError, match=r"--dsn.*OUTBOX_DSN"):
        load_settings(kafka=False)
    assert RelaySettings.model_fields["dsn"].is_required()


# -- the database a command uses, named without its password -------------------------------------

@pytest.mark.parametrize(("dsn", "expected"), [
    ("postgresql://outbox_relay:s3cret-pw@db.internal:5432/app", "database app on db.internal:5432 as outbox_relay"),
    ("postgresql://outbox_relay:s3cret-pw@db.internal/app", "database app on db.internal:5432 as outbox_relay"),
    ("host=db.internal port=6432 user=relay password=s3cret-pw dbname=shop",
     "database shop on db.internal:6432 as relay"),
    ("postgresql://relay:s3cret-pw@/shop?host=/tmp/pg", "database shop on socket /tmp/pg (port 5432) as relay"),
    ("postgresql://relay@h1:5432,h2:5433/shop", "database shop on h1:5432, h2:5433 as relay"),
    ("postgresql://relay@db/", "database relay on db:5432 as relay"),  # libpq: the database defaults to the user
])
def test_describe_names_database_host_and_user_never_the_password(dsn: str, expected: str) -> None:
    assert describe(dsn) == expected


def test_describe_falls_back_to_the_libpq_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGHOST", "pg.example")
    monkeypatch.setenv("PGUSER", "svc")
    monkeypatch.setenv("PGDATABASE", "orders")
    assert describe("postgresql://") == "database orders on pg.example:5432 as svc"


# -- Kafka needs its bootstrap servers; projections need no Kafka ---------------------------------

def test_run_with_kafka_and_no_bootstrap_servers_is_refused(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DSN", UNREACHABLE)
    code, _, err = run_cli(capsys, "run")
    assert code == cli.EXIT_ERROR, err
    assert "--kafka-bootstrap-servers" in err and "OUTBOX_KAFKA_BOOTSTRAP_SERVERS" in err and "--no-kafka" in err, err
    assert err.count("\n") == 1 and "Unre4chable" not in err, err


def test_replay_without_bootstrap_servers_is_refused(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DSN", UNREACHABLE)
    code, _, err = run_cli(capsys, "replay", "--topic", "orders")
    assert code == cli.EXIT_ERROR and "--kafka-bootstrap-servers" in err, err


def test_projection_only_settings_need_no_kafka_setting() -> None:
    settings = load_settings(dsn=UNREACHABLE, kafka=False, projections="app.models", projection=["totals"])
    assert settings.sinks == ["totals"] and settings.kafka_bootstrap_servers is None
    with pytest.raises(ConfigurationError, match="--kafka-bootstrap-servers"):
        load_settings(dsn=UNREACHABLE).kafka_producer_config()


def test_projections_module_without_a_projection_is_refused(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DSN", UNREACHABLE)
    code, _, err = run_cli(capsys, "run", "--no-kafka", "--projections", "app.models")
    assert code == cli.EXIT_ERROR, err
    assert "--projections" in err and "--projection" in err and err.count("\n") == 1, err


def test_replay_accepts_a_kafka_config_file(tmp_path: Path) -> None:
    config = tmp_path / "kafka.properties"
    config.write_text("security.protocol=SSL\n")
    args = cli.build_parser().parse_args(["replay", "--topic", "t", "--dsn", UNREACHABLE,
                                          "--kafka-bootstrap-servers", "k:9092", "--kafka-config-file", str(config)])
    assert common._settings_from(args).kafka_producer_config()["security.protocol"] == "SSL"


# -- --help ------------------------------------------------------------------------------------

def _help(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", "250")  # one option per line, whatever the terminal running the tests
    code, out, _ = run_cli(capsys, *argv, "--help")
    assert code == 0
    return " ".join(out.split())


def test_run_help_shows_every_default(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    text = _help(capsys, monkeypatch, "run")
    for expected in ("(default 1000)", "(default 30)", "(default on)", "(default off)", "(default host-pid)",
                     "(default kafka)", "(required)", "(default none)"):
        assert expected in text, expected
    # Every setting says its default (or that it has none).
    for name in RelaySettings.model_fields:
        if name in ("webhook_secret", "rabbitmq_password"):  # environment only (a command line shows in `ps`)
            assert f"{flag(name)} " not in text
            continue
        option = flag(name)
        start = max(m.start() for m in re.finditer(re.escape(option) + "[ ,]", text))  # its help, not the usage
        assert "(default " in text[start:start + 900] or "(required)" in text[start:start + 900], name


@pytest.mark.parametrize(("command", "actions"), [
    (["dead-letters"], ["list", "retry", "discard"]),
    (["sinks"], ["list", "drop", "recreate"]),
])
def test_every_action_has_help(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                               command: list[str], actions: list[str]) -> None:
    text = _help(capsys, monkeypatch, *command)
    for action in actions:
        # "list   list dead letters ..." : the action followed by its own help text
        assert f" {action} " in text and text.count(action) >= 2, (action, text)
    for action in actions:
        assert run_cli(capsys, *command, action, "--help")[0] == 0


def test_other_commands_show_defaults(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    text = _help(capsys, monkeypatch, "dead-letters")
    assert "(default 50)" in text
    text = _help(capsys, monkeypatch, "rebuild")
    assert "(default 1000)" in text


# -- tables fit the terminal ---------------------------------------------------------------------

def test_tables_fit_the_terminal(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    rows = [("kafka", "01900000-0000-7000-8000-000000000000", "order-1", "x" * 500 + "\x1b[31m"),
            ("totals", "01900000-0000-7000-8000-000000000001", "k\x1b]0;title\x07", "short")]
    output._print_table(rows, ["sink", "event_id", "partition_key", "last_error"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), [len(line) for line in lines]
    assert "\u2026" in out and "01900000-0000-7000-8000-000000000000" in out, out  # ids whole, long text cut
    assert "\x1b" not in out and "\x07" not in out and "k\\x1b]0;title\\x07" in out, out


def test_tables_are_whole_when_they_fit(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    output._print_table([("kafka", "x" * 100)], ["sink", "last_error"])
    out = capsys.readouterr().out
    assert "x" * 100 in out and "\u2026" not in out


@pytest.mark.parametrize("argv", [["run", "--no-kafka"], ["status"]])
def test_an_empty_dsn_is_no_dsn(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                argv: list[str]) -> None:
    """libpq reads "" as "every default" (the local server's database named after the user): refused."""
    monkeypatch.setenv("OUTBOX_DSN", " ")
    code, _, err = run_cli(capsys, *argv)
    assert code == cli.EXIT_ERROR and "no database given" in err, err


def test_the_top_level_help_is_plain_text_and_names_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    from outbox_relay import cli

    cli.main(["--help"])
    out = capsys.readouterr().out
    description = out.split("positional arguments:")[0]
    assert "``" not in out, description
    for command in cli.COMMANDS:
        assert command.split()[0] in description, (command, description)
    assert "inbox" in description
