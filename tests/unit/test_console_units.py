"""The console's parts that need no database: token files, the origin check, the action forms' checks,
the charts' rates."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from outbox_relay.admin import Sample
from outbox_relay.console.actions import parse_plan
from outbox_relay.console.charts import delivered_rates, overview_charts
from outbox_relay.console.security import csrf_ok, load_tokens, match_token, same_origin
from outbox_relay.dsn import redact
from outbox_relay.errors import OutboxError


def test_a_token_file_gives_labels_and_keeps_the_tokens_out_of_logs(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# ops\nalice ops team 0123456789abcdef-a\n\n0123456789abcdef-b\n")
    tokens = load_tokens(path)
    assert [t.label for t in tokens] == ["alice ops team", "token 2"]
    assert "0123456789abcdef" not in repr(tokens)
    assert "0123456789abcdef-a" not in redact("an error that quotes 0123456789abcdef-a")
    assert match_token(tokens, "0123456789abcdef-b") is tokens[1]
    assert match_token(tokens, "0123456789abcdef-") is None


def test_the_origin_and_csrf_checks() -> None:
    assert same_origin(None, "127.0.0.1:8080", "http")
    assert same_origin("http://127.0.0.1:8080", "127.0.0.1:8080", "http")
    assert not same_origin("http://evil.example", "127.0.0.1:8080", "http")
    assert not same_origin("null", "127.0.0.1:8080", "http")
    assert csrf_ok("abc", "abc") and not csrf_ok("abc", "abd") and not csrf_ok(None, None) and not csrf_ok("", "")


@pytest.mark.parametrize(("form", "error"), [
    ({"action": "drop-table", "sink": "s"}, "no such action"),
    ({"action": "retry-key", "sink": ""}, "say which sink"),
    ({"action": "retry-key", "sink": "s"}, "say which key"),
    ({"action": "retry-dead", "sink": "s", "scope": "some"}, "say which dead letters"),
    ({"action": "retry-dead", "sink": "s", "scope": "selected", "event": []}, "no dead letter is selected"),
    ({"action": "retry-dead", "sink": "s", "scope": "selected", "event": ["x"]}, "not an event id"),
    ({"action": "discard-dead", "sink": "s", "scope": "key"}, "needs the key"),
])
def test_an_action_form_names_what_is_wrong(form: dict[str, object], error: str) -> None:
    with pytest.raises(OutboxError, match=error):
        parse_plan(form)


def test_a_plan_says_what_it_will_do() -> None:
    plan = parse_plan({"action": "discard-dead", "sink": "s", "scope": "all", "key": "ignored"})
    assert plan.describe() == "Discard for good every dead letter of sink 's'." and plan.key is None
    plan = parse_plan({"action": "pause-key", "sink": "s", "key": "k", "reason": " why "})
    assert plan.target() == "key k (reason: why)"


def test_delivered_per_second_is_stored_less_backlog_growth() -> None:
    t = datetime(2026, 12, 2, tzinfo=UTC)
    samples = [Sample("s", t, 100, 0, 0, 6000), Sample("s", t + timedelta(minutes=1), 160, 0, 0, 6000),
               Sample("s", t + timedelta(minutes=2), 40, 0, 0, 0)]
    assert delivered_rates(samples) == [(t + timedelta(minutes=1), 99.0), (t + timedelta(minutes=2), 2.0)]
    backlog, rates = overview_charts(samples)
    assert backlog.top == 160 and [s.name for s in rates.series] == ["(stored/s)", "s"]
    assert not backlog.empty and overview_charts([])[0].empty
