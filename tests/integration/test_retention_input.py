"""The retention command against what operators get wrong: the relays' retention given as a number
the relays themselves refuse (NaN, infinite, negative, beyond 3650 days) is refused with a message that
names it, from the option and from the environment, instead of a database error or a negative keep."""

from __future__ import annotations

import pytest

from outbox_relay import cli
from tests.cli_helpers import run_cli

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "1e308", "3650.1d"])
def test_a_retention_the_relays_would_refuse_is_refused(dsn: str, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    for action in ("list", "partitions"):
        code, out, err = run_cli(capsys, "retention", action, "--retention-seconds", value, "--dsn", dsn)
        assert code == cli.EXIT_ERROR and out == "", (action, out, err)
        assert "--retention-seconds" in err and "database error" not in err, err
    monkeypatch.setenv("OUTBOX_RETENTION_SECONDS", value)
    for argv in (["retention", "list"], ["status"]):
        code, out, err = run_cli(capsys, *argv, "--dsn", dsn)
        assert code == cli.EXIT_ERROR and "OUTBOX_RETENTION_SECONDS" in err and "database error" not in err, err


def test_a_retention_in_range_is_shown(dsn: str, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run_cli(capsys, "retention", "list", "--retention-seconds", "0", "--dsn", dsn)
    assert code == cli.EXIT_OK, err
    monkeypatch.setenv("OUTBOX_RETENTION_SECONDS", "3600")
    code, out, err = run_cli(capsys, "retention", "list", "--dsn", dsn)
    assert code == cli.EXIT_OK and "01:00:00" in out, (out, err)
