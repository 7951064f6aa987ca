"""The operator console over HTTP (Starlette's TestClient, the real app, a real PostgreSQL and real relay
runners): every page renders the database's state, producer-written strings come out as text, actions
are confirmed, audited and refused without the token or the CSRF value, and the security headers are set."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool
from starlette.testclient import TestClient

from outbox_relay import Outbox, admin
from outbox_relay.console import create_app
from outbox_relay.console.security import CSP, CSRF_COOKIE
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    SINK,
    RecordingSink,
    fail_ids,
    make_settings,
    parked_ids,
    pool_fixture,
    run_until,
    runner_for,
)

SCRIPT = "<script>alert(1)</script>"
IMG = '"><img src=x onerror=alert(1)>'
TOKEN = "s3cret-token-of-the-console-0123456789"


def escaped_everywhere(html: str, text: str) -> bool:
    """``text`` appears only escaped: no raw tag of it in the page."""
    return text not in html and "<script>alert" not in html and "<img src=x" not in html


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(f"# console tokens\nalice {TOKEN}\n")
    return path


@pytest.fixture
def state(dsn: str, pool: ConnectionPool[Any]) -> dict[str, Any]:
    """A sink with a dead letter of key SCRIPT (type IMG, XSS header, payload and error) and a retrying key IMG."""
    outbox = Outbox(default_topic="orders")
    with psycopg.connect(dsn) as conn:
        dead = outbox.publish(conn, type=IMG, key=SCRIPT, payload={"note": SCRIPT, IMG: 1},
                              headers={"x-note": SCRIPT}).id
        retrying = outbox.publish(conn, type="order.placed", key=IMG, payload={}).id
        fine = outbox.publish(conn, type="order.placed", key="fine", payload={}).id
    fails = {dead, retrying}
    sink = RecordingSink(fail=lambda e, n: fail_ids(fails, f"handler said {SCRIPT} {IMG}")(e, n))
    settings = make_settings(dsn, "w", max_attempts=1, backoff_base_seconds=60, backoff_max_seconds=60)
    runner = runner_for(sink, pool, settings)
    run_until(runner, lambda: fine in sink.delivered_ids() and len(parked_ids(dsn)) == 0
              and _dead(dsn) == 2)
    # the retrying key: its head is parked again by a retry of its dead letter, with 60 s backoff
    with psycopg.connect(dsn, autocommit=True) as conn:
        admin.retry_dead_letters(conn, SINK, event_ids=[retrying])
    fails.discard(dead)  # "fix the cause" for key SCRIPT only; its dead letter waits for a retry
    settings2 = make_settings(dsn, "w", max_attempts=5, backoff_base_seconds=60, backoff_max_seconds=60)
    runner2 = runner_for(sink, pool, settings2)
    run_until(runner2, lambda: _attempts(dsn, retrying) >= 1)
    return {"dead": dead, "retrying": retrying, "fine": fine, "sink": sink, "runner": runner2, "fails": fails}


def _dead(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM outbox.dead_letters").fetchone()
    return int(row[0]) if row else 0


def _attempts(dsn: str, event: uuid.UUID) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT attempts FROM outbox.parked WHERE event_id = %s", (event,)).fetchone()
    return int(row[0]) if row else 0


@pytest.fixture
def client(dsn: str, token_file: Path) -> Iterator[TestClient]:
    with TestClient(create_app(dsn, token_file=token_file, sample_seconds=None), base_url="http://127.0.0.1") as c:
        yield c


def csrf_of(client: TestClient) -> str:
    client.get("/")
    value = client.cookies.get(CSRF_COOKIE)
    assert value
    return value


def sign_in(client: TestClient, operator: str = "") -> None:
    r = client.post("/signin", data={"token": TOKEN, "operator": operator, "next": "/", "csrf": csrf_of(client)},
                    follow_redirects=False)
    assert r.status_code == 303, r.text


def test_every_page_carries_the_security_headers(client: TestClient, state: dict[str, Any]) -> None:
    for path in ("/", f"/sinks/{SINK}", "/events", f"/events?id={state['dead']}", "/history", "/audit",
                 "/signin", "/no-such-page"):
        r = client.get(path)
        assert r.headers["content-security-policy"] == CSP, path
        assert "frame-ancestors 'none'" in CSP and "default-src 'self'" in CSP and "'unsafe-inline'" not in CSP
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["cache-control"] == "no-store", path
    assert client.get("/static/console.js").headers["cache-control"].startswith("public")


def test_pages_show_the_state_and_hostile_strings_as_text(client: TestClient, state: dict[str, Any],
                                                          dsn: str) -> None:
    overview = client.get("/").text
    assert f'href="/sinks/{SINK}"' in overview and "w" in overview
    sink = client.get(f"/sinks/{SINK}").text
    assert escaped_everywhere(sink, SCRIPT) and escaped_everywhere(sink, IMG)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in sink  # the dead letter's key, as text
    assert "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in sink  # the waiting key, as text
    # the waiting key says why, in the words of `keys show`
    with psycopg.connect(dsn) as conn:
        said = admin.key_state(conn, IMG, sink=SINK, max_attempts=admin.DEFAULT_MAX_ATTEMPTS).sinks[0].summary
    assert said.startswith("waiting for a retry in ")
    assert "waiting for a retry in " in sink and "failed: handler said &lt;script&gt;" in sink
    event = client.get(f"/events?id={state['dead']}").text
    assert escaped_everywhere(event, SCRIPT) and escaped_everywhere(event, IMG)
    assert "dead-lettered" in event and "x-note" in event
    by_key = client.get("/events", params={"key": SCRIPT}).text
    assert escaped_everywhere(by_key, SCRIPT) and str(state["dead"]) in by_key
    assert client.get("/history").status_code == 200
    assert "<script" not in client.get("/events", params={"key": SCRIPT, "id": ""}).text.replace(
        '<script src="/static/console.js" defer></script>', "")


class Elements(HTMLParser):
    """Every element of a page with its attributes, as a browser's parser sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, dict(attrs)))


def test_no_inline_script_style_or_handler_in_any_page(client: TestClient, state: dict[str, Any]) -> None:
    for path in ("/", f"/sinks/{SINK}", f"/events?id={state['dead']}", f"/events?key={SCRIPT}", "/history",
                 "/audit", "/signin"):
        parser = Elements()
        parser.feed(client.get(path).text)
        tags = parser.found
        assert [a for t, a in tags if t == "script"] == [{"src": "/static/console.js", "defer": None}], path
        assert not [t for t, _ in tags if t in ("style", "img", "iframe", "object")], path
        handlers = [(t, n) for t, a in tags for n in a if n.startswith("on") or n == "style"]
        assert handlers == [], (path, handlers)  # no event handler or inline style, ours or a producer's


def _confirm_and_run(client: TestClient, fields: dict[str, Any]) -> str:
    csrf = client.cookies.get(CSRF_COOKIE) or csrf_of(client)
    confirm = client.post("/actions/confirm", data={**fields, "csrf": csrf})
    assert confirm.status_code == 200, confirm.text
    hidden = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">',
                        confirm.text.split('action="/actions/run"')[1])
    data: dict[str, Any] = {}
    for name, value in hidden:
        data.setdefault(name, []).append(value.replace("&#34;", '"').replace("&lt;", "<").replace("&gt;", ">")
                                         .replace("&#39;", "'").replace("&amp;", "&"))
    done = client.post("/actions/run", data=data)
    assert done.status_code == 200, done.text
    return done.text


def test_retry_a_dead_letter_after_the_fix_delivers_it_and_audits(client: TestClient, state: dict[str, Any],
                                                                   dsn: str) -> None:
    sign_in(client, operator="Bob")
    done = _confirm_and_run(client, {"action": "retry-dead", "sink": SINK, "scope": "selected",
                                     "event": [str(state["dead"])]})
    assert "1 dead letter(s) queued again" in done
    run_until(state["runner"], lambda: state["dead"] in state["sink"].delivered_ids())
    audit = client.get("/audit").text
    assert "Bob (token alice)" in audit and "retry-dead" in audit and str(state["dead"]) in audit
    with psycopg.connect(dsn) as conn:
        rows = admin.audit_log(conn).records()
    assert (rows[0]["who"], rows[0]["action"], rows[0]["count"], rows[0]["refused"]) == (
        "Bob (token alice)", "retry-dead", 1, None)


def test_pause_resume_retry_and_skip_a_key(client: TestClient, state: dict[str, Any], dsn: str) -> None:
    sign_in(client)
    assert "its events are held until resumed" in _confirm_and_run(
        client, {"action": "pause-key", "sink": SINK, "key": IMG, "reason": SCRIPT})
    sink = client.get(f"/sinks/{SINK}").text
    assert "paused since" in sink and escaped_everywhere(sink, SCRIPT)
    # paused: a retry is refused (admin's words), and the refusal is audited
    refused = client.post("/actions/run", data={"action": "retry-key", "sink": SINK, "key": IMG,
                                                "csrf": client.cookies.get(CSRF_COOKIE)})
    assert refused.status_code == 409 and "is paused for sink" in refused.text
    assert "1 held event(s) due now" in _confirm_and_run(client, {"action": "resume-key", "sink": SINK, "key": IMG})
    assert "is due now" in _confirm_and_run(client, {"action": "retry-key", "sink": SINK, "key": IMG})
    assert "went to dead letters" in _confirm_and_run(client, {"action": "skip-key", "sink": SINK, "key": IMG})
    with psycopg.connect(dsn) as conn:
        actions = [(r["action"], r["who"], r["refused"] is None) for r in admin.audit_log(conn).records()]
    assert actions == [("skip-key", "alice", True), ("retry-key", "alice", True), ("resume-key", "alice", True),
                       ("retry-key", "alice", False), ("pause-key", "alice", True)]


def test_discard_all_of_a_key_filter(client: TestClient, state: dict[str, Any], dsn: str) -> None:
    sign_in(client)
    done = _confirm_and_run(client, {"action": "discard-dead", "sink": SINK, "scope": "key", "key": SCRIPT})
    assert "1 dead letter(s) deleted" in done
    with psycopg.connect(dsn) as conn:
        assert admin.dead_letters(conn, sink=SINK, key=SCRIPT).rows == []


def test_actions_are_refused_without_the_token_or_the_csrf_value(client: TestClient, state: dict[str, Any],
                                                                 dsn: str) -> None:
    fields = {"action": "discard-dead", "sink": SINK, "scope": "all"}
    csrf = csrf_of(client)
    for path in ("/actions/confirm", "/actions/run"):
        r = client.post(path, data={**fields, "csrf": csrf})
        assert r.status_code == 403 and "actions need the console&#39;s token: sign in first" in r.text
    bad = client.post("/signin", data={"token": "not-" + TOKEN, "next": "/", "csrf": csrf})
    assert bad.status_code == 403 and TOKEN not in bad.text
    sign_in(client)
    for data in ({**fields}, {**fields, "csrf": "forged"}):
        r = client.post("/actions/run", data=data)
        assert r.status_code == 403 and "CSRF" in r.text
    r = client.post("/actions/run", data={**fields, "csrf": csrf}, headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and "another site" in r.text
    with psycopg.connect(dsn) as conn:
        assert len(admin.dead_letters(conn, sink=SINK).rows) == 1  # nothing was discarded
        assert admin.audit_log(conn).rows == []


def test_a_console_without_a_token_file_is_read_only(dsn: str, state: dict[str, Any]) -> None:
    with TestClient(create_app(dsn, sample_seconds=None), base_url="http://127.0.0.1") as c:
        assert "read-only" in c.get("/").text
        sink = c.get(f"/sinks/{SINK}").text
        assert "Retry selected" not in sink and "Pause a key" not in sink  # no action offered
        r = c.post("/actions/run", data={"action": "discard-dead", "sink": SINK, "scope": "all",
                                         "csrf": csrf_of(c)})
        assert r.status_code == 403 and "read-only" in r.text


def test_reading_needs_a_session_when_the_console_listens_beyond_this_host(dsn: str, token_file: Path) -> None:
    app = create_app(dsn, token_file=token_file, read_needs_token=True, sample_seconds=None)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        for path in ("/", f"/sinks/{SINK}", "/events", "/history", "/audit"):
            r = c.get(path, follow_redirects=False)
            assert r.status_code == 303 and r.headers["location"].startswith("/signin"), path
        sign_in(c)
        assert c.get("/").status_code == 200


def test_the_dsn_password_is_not_shown(pg_server: Any, dsn: str) -> None:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    with_password = make_conninfo(dsn, password="hunter2-hunter2")
    assert "password" in conninfo_to_dict(with_password)
    with TestClient(create_app(with_password, sample_seconds=None), base_url="http://127.0.0.1") as c:
        page = c.get("/").text
    assert "hunter2-hunter2" not in page and "database:" in page


def test_samples_draw_the_overview_charts(client: TestClient, state: dict[str, Any], dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        minute = admin.take_sample(conn)
        admin.take_sample(conn)  # the same minute again: stored once
        conn.execute("UPDATE outbox.console_samples SET at = at - interval '1 minute'")
        admin.take_sample(conn)
        samples = admin.samples_since(conn, 61)
    assert [s.at for s in samples] == [minute - __import__("datetime").timedelta(minutes=1), minute]
    page = client.get("/").text
    assert page.count("<polyline") >= 3 and "No samples yet" not in page


def test_a_token_file_is_checked_at_start(tmp_path: Path, dsn: str) -> None:
    from outbox_relay.errors import ConfigurationError

    short = tmp_path / "short"
    short.write_text("alice short\n")
    with pytest.raises(ConfigurationError, match="a token is at least 16 characters"):
        create_app(dsn, token_file=short)
    with pytest.raises(ConfigurationError, match="cannot read the console token file"):
        create_app(dsn, token_file=tmp_path / "missing")
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigurationError, match="holds no token"):
        create_app(dsn, token_file=tmp_path / "empty")


@pytest.fixture
def console_role(pg_server: Any, dsn: str) -> Iterator[str]:
    """The conninfo of a login holding exactly docs/roles.md's outbox_console rights (the block as written,
    its roles renamed for this test)."""
    from outbox_relay import privileges
    from tests.integration.doc_roles import doc_roles

    roles = privileges.roles_of(privileges.OUTBOX)
    with doc_roles(pg_server, dsn, roles) as r, psycopg.connect(dsn, autocommit=True) as su:
        for role in roles:
            su.execute(f'CREATE ROLE "{r["names"][role]}" LOGIN')
        su.execute(r["rename"](privileges.grants_sql(privileges.OUTBOX)))
        yield r["as"](privileges.CONSOLE)


def test_the_console_role_can_do_every_page_and_action_and_no_more(console_role: str, token_file: Path,
                                                                   state: dict[str, Any], dsn: str) -> None:
    with TestClient(create_app(console_role, token_file=token_file, sample_seconds=None),
                    base_url="http://127.0.0.1") as c:
        for path in ("/", f"/sinks/{SINK}", f"/events?id={state['dead']}", f"/events?key={SCRIPT}", "/history",
                     "/audit"):
            assert c.get(path).status_code == 200, path
        sign_in(c)
        assert "its events are held" in _confirm_and_run(c, {"action": "pause-key", "sink": SINK, "key": IMG})
        assert "held event(s) due now" in _confirm_and_run(c, {"action": "resume-key", "sink": SINK, "key": IMG})
        assert "is due now" in _confirm_and_run(c, {"action": "retry-key", "sink": SINK, "key": IMG})
        assert "went to dead letters" in _confirm_and_run(c, {"action": "skip-key", "sink": SINK, "key": IMG})
        assert "queued again" in _confirm_and_run(c, {"action": "retry-dead", "sink": SINK, "scope": "key",
                                                      "key": IMG})
        assert "deleted" in _confirm_and_run(c, {"action": "discard-dead", "sink": SINK, "scope": "all"})
    with psycopg.connect(console_role, autocommit=True) as conn:
        admin.take_sample(conn)
        assert conn.execute("SELECT session_user").fetchone() == (conn.info.user,)
        assert admin.audit_log(conn).records()[0]["role"] == conn.info.user
        for refused in ("DELETE FROM outbox.events", "UPDATE outbox.workers SET status = 'dead'",
                        "UPDATE outbox.cursors SET owner = NULL", "DELETE FROM outbox.console_audit",
                        "UPDATE outbox.sinks SET dropped_at = now()", "SELECT outbox.retire_partition_v2()"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(refused)


def test_the_command_refuses_to_listen_beyond_this_host_without_a_token_file(
        capsys: pytest.CaptureFixture[str], dsn: str) -> None:
    from outbox_relay import cli
    from tests.cli_helpers import run_cli

    code, _, err = run_cli(capsys, "console", "--dsn", dsn, "--host", "0.0.0.0")
    assert code == cli.EXIT_ERROR
    assert "listening on 0.0.0.0 (beyond this host) needs --token-file" in err, err
