"""`outbox-relay` through ``cli.main([...])`` with bad input: one line naming the problem, exit code 2;
an unexpected exception: one line with its type, exit code 3 (the traceback only with --log-level
debug). Nothing here reaches a database: every case fails before connecting."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox_relay import cli
from tests.cli_helpers import run_cli

UNREACHABLE = "postgresql://relay:Unre4chable-pw@127.0.0.1:1/app"  # nothing listens on port 1


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No OUTBOX_* from the caller's environment. (conftest puts the root logger back.)"""
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OUTBOX_DSN", UNREACHABLE)
    yield


@pytest.mark.parametrize(("argv", "message"), [
    (["--log-level", "verbose", "status"], "'verbose' is not a log level"),
    (["dead-letters", "list", "--limit", "-1"], "argument --limit: must be 1-10000, not -1"),
    (["dead-letters", "list", "--limit", "lots"], "argument --limit: not an integer"),
    (["dead-letters", "retry", "--sink", "kafka", "--event", "not-a-uuid"], "an event id is a UUID, not 'not-a-uuid'"),
    (["sinks", "drop", "x", "--worker-ttl-seconds", "inf"], "must be 0.02-3600 seconds"),
    (["run", "--lease-seconds", "inf"], "lease_seconds (--lease-seconds, OUTBOX_LEASE_SECONDS): Input should be a "
                                        "finite number"),
    (["run", "--poll-seconds", "1e12"], "--poll-seconds, OUTBOX_POLL_SECONDS): Input should be less than or equal "
                                        "to 3600"),
    (["run", "--kafka-sink", "Bad Name"], "--kafka-sink, OUTBOX_KAFKA_SINK): a sink name is 1-63 characters"),
    (["run", "--kafka-option", "no-equals-sign"], "--kafka-option needs KEY=VALUE"),
    (["status", "--dsn", "postgresql://relay:pa%zzss@db/app"], "the DSN is not a valid PostgreSQL connection string"),
    (["status", "--dsn", "postgresql://relay:pa ss@db/app"], "the DSN is not a valid PostgreSQL connection string"),
    (["run", "--dsn", "host=db password=pa ss"], "the DSN is not a valid PostgreSQL connection string"),
    (["run", "--no-kafka", "--projection", "x"], "--projection needs --projections"),
    # Names and keys no stored event can have: refused, rather than "0 events" and exit 0.
    (["replay", "--topic", "or ders", "--kafka-bootstrap-servers", "k:9"], "'or ders' is not a valid topic name"),
    (["replay", "--topic", "orders", "--to-topic", "..", "--kafka-bootstrap-servers", "k:9"],
     "'..' is not a valid topic name"),
    (["replay", "--topic", "orders", "--key", "", "--kafka-bootstrap-servers", "k:9"], "a partition key is not empty"),
    (["rebuild", "totals", "--projections", "m", "--key", "k" * 1025], "a partition key is at most 1024 bytes"),
    (["dev", "--topic", "."], "'.' is not a valid topic name"),
])
def test_bad_input_is_one_line_with_exit_code_2(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                 message: str) -> None:
    code, _, err = run_cli(capsys, *argv)
    assert code == cli.EXIT_ERROR, err
    assert message in err, err
    assert "Traceback" not in err and "pa ss" not in err and "pa%zz" not in err, err


def test_usage_errors_from_argparse_return_2_instead_of_exiting(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "no-such-command")
    assert code == 2 and "invalid choice" in err


def test_a_database_that_is_not_reachable_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["status"], ["lag"], ["dead-letters", "list"], ["sinks", "list"], ["migrate"]):
        code, _, err = run_cli(capsys, *argv)
        assert code == cli.EXIT_ERROR, (argv, err)
        assert err.count("\n") == 1 and ("not reachable" in err or "cannot connect" in err), (argv, err)
        assert "Unre4chable" not in err, (argv, err)


@pytest.mark.parametrize("raised", ["ZeroDivisionError", "RuntimeError", "SyntaxError", "ImportError"])
def test_a_projection_module_that_raises_at_import_is_a_configuration_error(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raised: str) -> None:
    module = f"broken_projections_{raised.lower()}"
    body = "1 +" if raised == "SyntaxError" else f"raise {raised}('the module is broken')"
    (tmp_path / f"{module}.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for argv in (["run", "--no-kafka", "--projections", module, "--projection", "totals"],
                 ["rebuild", "totals", "--projections", module]):
        code, _, err = run_cli(capsys, *argv)
        assert code == cli.EXIT_ERROR, err
        assert f"--projections {module}: importing module {module!r} failed: " in err, err
        assert ("the module is broken" if raised != "SyntaxError" else "SyntaxError") in err, err
        assert "Traceback" not in err


def test_an_unexpected_exception_is_one_line_with_exit_code_3(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(_args: object) -> int:
        raise RuntimeError(f"something broke near {UNREACHABLE}")

    monkeypatch.setitem(cli.COMMANDS, "status", boom)
    code, _, err = run_cli(capsys, "status")
    assert code == cli.EXIT_INTERNAL
    assert err.startswith("outbox-relay: unexpected error: RuntimeError: something broke near "), err
    assert err.count("\n") == 1 and "Traceback" not in err and "Unre4chable" not in err, err

    code, _, err = run_cli(capsys, "--log-level", "debug", "status")
    assert code == cli.EXIT_INTERNAL
    assert "Traceback" in err and "RuntimeError" in err and "Unre4chable" not in err, err


def test_ctrl_c_is_one_line_with_exit_code_130(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "status", interrupted)
    try:
        code = cli.main(["status"])
    except KeyboardInterrupt:  # escaping main would also stop this test run
        pytest.fail("Ctrl-C escaped main() as a traceback")
    err = capsys.readouterr().err
    assert code == cli.EXIT_INTERRUPTED and err == "outbox-relay: interrupted\n", err


def test_log_level_is_case_insensitive(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cli.COMMANDS, "status", lambda _args: 0)
    assert run_cli(capsys, "--log-level", "WARNING", "status")[0] == 0
