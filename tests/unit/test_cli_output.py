"""What `outbox-relay` prints: JSON with numbers as numbers and ISO times, tables without Python
reprs, --version, and the global options after the command too."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from outbox_relay import cli
from outbox_relay.cli import output


def test_json_values() -> None:
    event = uuid.UUID("01900000-0000-7000-8000-000000000000")
    row = {"seen_seconds_ago": Decimal("0.4"), "pending": Decimal("12"), "leased": 141,
           "dead_at": datetime(2026, 11, 23, 12, 0, 1, tzinfo=UTC), "event_id": event,
           "buckets": {"kafka": 141}, "sinks": ["kafka", "totals"], "prepared": False, "gid": None}
    assert json.loads(json.dumps(output._json_value(row))) == {
        "seen_seconds_ago": 0.4, "pending": 12, "leased": 141, "dead_at": "2026-11-23T12:00:01+00:00",
        "event_id": str(event), "buckets": {"kafka": 141}, "sinks": ["kafka", "totals"], "prepared": False,
        "gid": None}


def test_table_cells_are_not_python_reprs(capsys: pytest.CaptureFixture[str]) -> None:
    output.print_table([("relay-a", ["kafka", "totals"], {"kafka": 141, "totals": 12}, True,
                      datetime(2026, 11, 23, 12, 0, 1, 250000, tzinfo=UTC), None, "line one\nline two")],
                    ["id", "sinks", "buckets", "prepared", "since", "gid", "error"])
    out = capsys.readouterr().out
    assert "kafka, totals" in out and "kafka: 141, totals: 12" in out and "2026-11-23 12:00:01+00:00" in out
    assert "yes" in out and "line one line two" in out
    assert not any(c in out for c in "[]{}'"), out
    assert "None" not in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"outbox-relay {cli.version()}"
    assert cli.version() == "0.1.0"


@pytest.mark.parametrize(("argv", "level", "as_json"), [
    (["status"], "info", False),
    (["--log-level", "debug", "--log-json", "status"], "debug", True),
    (["status", "--log-level", "WARNING", "--log-json"], "warning", True),
    (["--log-level", "debug", "status", "--log-level", "error"], "error", False),
    (["run", "--log-json", "--no-kafka"], "info", True),
    (["dead-letters", "list", "--log-level", "debug"], "debug", False),
])
def test_global_options_before_or_after_the_command(argv: list[str], level: str, as_json: bool) -> None:
    args = cli.build_parser().parse_args(argv)
    assert (args.log_level, args.log_json) == (level, as_json)


@pytest.mark.parametrize("command", [["status"], ["lag"], ["dead-letters", "list"], ["sinks", "list"]])
def test_every_read_command_has_json(command: list[str]) -> None:
    assert cli.build_parser().parse_args([*command, "--json"]).json is True


@pytest.mark.parametrize(("raw", "shown"), [
    ("k\x1b[31m", "k\\x1b[31m"), ("bell\x07", "bell\\x07"), ("over\rwrite", "over\\x0dwrite"),
    ("c1\x9b2J", "c1\\x9b2J"), ("del\x7f", "del\\x7f"), ("nul\x00", "nul\\x00"),
    ("abc\u202edcba", "abc\\u202edcba"), ("iso\u2066late\u2069", "iso\\u2066late\\u2069"),
    ("caf\u00e9 \u00fc\u00df \u65e5\u672c", "caf\u00e9 \u00fc\u00df \u65e5\u672c"),  # letters stay letters
])
def test_printable_escapes_what_a_terminal_would_act_on(raw: str, shown: str) -> None:
    assert output.printable(raw) == shown
    assert output.table_cell(raw) == shown
