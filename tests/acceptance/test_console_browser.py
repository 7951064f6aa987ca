"""The console in a real browser (Debian's chromium, headless, driven by Playwright) against a real
`outbox-relay run` delivering to a user sink and a real PostgreSQL, the console under uvicorn: find a dead
letter from the overview, fix its cause, retry it and see it delivered; pause and resume a key; hostile
strings render as text (no dialog fires); an action without the token is refused. It takes the docs'
screenshots: into assets/console-screenshots/console-*.png with OUTBOX_CONSOLE_SCREENSHOTS=1 set (else into the test's
temporary directory, so that a test run leaves the work tree as it was)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from outbox_relay import Outbox, admin
from outbox_relay.errors import OutboxError
from tests.servers import wait_until

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
DOC_IMAGES = HERE.parents[1] / "assets" / "console-screenshots"  # outside docs/: the book is text
CHROMIUM = Path("/usr/bin/chromium")
SINK = "orders-sink"
SCRIPT = "<script>alert(1)</script>"
IMG = '"><img src=x onerror=alert(1)>'
TOKEN = "acceptance-token-0123456789abcdef"
FAST = ["--heartbeat-seconds", "0.5", "--worker-ttl-seconds", "2", "--housekeeping-seconds", "0.5",
        "--poll-seconds", "0.2", "--max-attempts", "2", "--backoff-base-seconds", "0.1",
        "--backoff-max-seconds", "0.2"]


# An hour of per-minute samples: 200 events stored a minute, a backlog that rises to 1,800 and drains.
SEED_SAMPLES = """
INSERT INTO outbox.console_samples (sink, at, pending, parked, dead_letters, published)
SELECT %(sink)s, date_trunc('minute', now()) - make_interval(mins => m),
       (CASE WHEN m BETWEEN 20 AND 40 THEN 1800 - abs(m - 30) * 170 ELSE 30 + m %% 7 END),
       (CASE WHEN m BETWEEN 20 AND 40 THEN 3 ELSE 0 END), 2, 12000
FROM generate_series(1, 60) m
ON CONFLICT DO NOTHING
"""


@pytest.fixture(scope="session")
def chromium() -> Path:
    """Debian's chromium: installed with apt-get when missing and we are root, else the test is skipped."""
    if not CHROMIUM.exists() and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, timeout=600)
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (apt-get install chromium, as root)")
    pytest.importorskip("playwright.sync_api")
    return CHROMIUM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def console_url(dsn: str, tmp_path: Path) -> Iterator[str]:
    """The console under a real uvicorn server, in this process, with a token file of label "ops"."""
    import uvicorn

    from outbox_relay.console import create_app

    tokens = tmp_path / "tokens"
    tokens.write_text(f"ops {TOKEN}\n")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(dsn, token_file=tokens, sample_seconds=None), host="127.0.0.1",
                                           port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=20, message="uvicorn to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)


@pytest.fixture
def relay(dsn: str, tmp_path: Path) -> Iterator[dict[str, Path]]:
    switch, delivered = tmp_path / "switch", tmp_path / "delivered"
    switch.write_text(f"order:7\n{SCRIPT}\n")
    script = Path(sys.executable).with_name("outbox-relay")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "outbox_relay.cli"]
    env = {**os.environ, "OUTBOX_DSN": dsn, "PYTHONPATH": str(HERE), "CONSOLE_SWITCH": str(switch),
           "CONSOLE_DELIVERED": str(delivered), "PYTHONUNBUFFERED": "1"}
    with (tmp_path / "relay.stderr").open("wb") as err:
        process = subprocess.Popen([*command, "run", "--worker-id", "relay-1", *FAST, "--no-kafka", "--sink",
                                    "console_sink:make_sink"], env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=err)
    try:
        yield {"switch": switch, "delivered": delivered, "stderr": tmp_path / "relay.stderr"}
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def delivered(paths: dict[str, Path]) -> set[str]:
    return set(paths["delivered"].read_text().split()) if paths["delivered"].exists() else set()


def dead_keys(dsn: str) -> set[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            return {r["partition_key"] for r in admin.dead_letters(conn, sink=SINK).records()}
        except OutboxError:  # the relay has not registered the sink yet
            return set()


def test_an_operator_gets_a_dead_letter_delivered_from_the_browser(chromium: Path, dsn: str, console_url: str,
                                                                   relay: dict[str, Path], tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    images = DOC_IMAGES if os.environ.get("OUTBOX_CONSOLE_SCREENSHOTS") == "1" else tmp_path

    outbox = Outbox(default_topic="orders")
    with psycopg.connect(dsn) as conn:
        stuck = outbox.publish(conn, type="OrderPlaced", key="order:7", payload={"total": 42}).id
        hostile = outbox.publish(conn, type=IMG, key=SCRIPT, payload={"note": SCRIPT, "html": IMG},
                                 headers={"x-note": IMG}).id
        fine = [outbox.publish(conn, type="OrderPlaced", key=f"order:{i}", payload={"total": i}).id
                for i in range(1, 4)]
    wait_until(lambda: dead_keys(dsn) == {"order:7", SCRIPT} and {str(f) for f in fine} <= delivered(relay),
               timeout=30, message=f"two dead letters; relay stderr: {relay['stderr'].read_text()[-1500:]}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        admin.take_sample(conn)  # the overview's charts (a running console samples every minute)

    dialogs: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(chromium), headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

        # The overview shows the relay and the sink with its dead letters; the sink's page has them.
        page.goto(console_url + "/")
        expect(page.locator("td.mono", has_text="relay-1")).to_be_visible()
        page.get_by_role("link", name=SINK).first.click()
        row = page.locator("tr.dead-letter", has_text="order:7")
        expect(row).to_contain_text("downstream refused key order:7")
        # The hostile key, type and error are text on the page.
        expect(page.locator("tr.dead-letter td.key", has_text=SCRIPT)).to_have_text(SCRIPT)

        # Without the token, an action is refused.
        row.locator('input[name="event"]').check()
        page.get_by_role("button", name="Retry selected…").click()
        expect(page.locator("p.problem")).to_contain_text("actions need the console's token: sign in first")
        assert dead_keys(dsn) == {"order:7", SCRIPT}

        # Sign in, fix the cause (the sink's switch), retry the dead letter, confirm: it is delivered.
        page.goto(f"{console_url}/signin?next=/sinks/{SINK}")
        page.fill('input[name="token"]', TOKEN)
        page.fill('input[name="operator"]', "Ada")
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator(".who")).to_contain_text("Ada (token ops)")
        relay["switch"].write_text(f"{SCRIPT}\n")
        page.screenshot(path=str(images / "console-sink.png"))
        page.locator("tr.dead-letter", has_text="order:7").locator('input[name="event"]').check()
        page.get_by_role("button", name="Retry selected…").click()
        expect(page.locator("p.confirm-what")).to_have_text(f"Retry 1 selected dead letter(s) of sink '{SINK}'.")
        page.get_by_role("button", name="Yes, do it").click()
        expect(page.locator("p.done-result")).to_contain_text("1 dead letter(s) queued again")
        wait_until(lambda: str(stuck) in delivered(relay), timeout=20, message="the retried event delivered")
        page.goto(f"{console_url}/events?id={stuck}")
        expect(page.locator("table.ledger tr", has_text=SINK)).to_contain_text("delivered", timeout=15000)
        page.screenshot(path=str(images / "console-event.png"))

        # Pause a key: its next event is held; resume it: delivered.
        page.goto(f"{console_url}/sinks/{SINK}")
        page.fill('input[name="key"][placeholder="key to pause"]', "order:1")
        page.fill('input[name="reason"]', "checking the warehouse")
        page.get_by_role("button", name="Pause a key…").click()
        page.get_by_role("button", name="Yes, do it").click()
        expect(page.locator("p.done-result")).to_contain_text("its events are held until resumed")
        with psycopg.connect(dsn) as conn:
            held = outbox.publish(conn, type="OrderPaid", key="order:1", payload={}).id

        def shows_held() -> bool:
            page.goto(f"{console_url}/sinks/{SINK}")
            return page.locator("tr.waiting-key", has_text="order:1").count() == 1

        wait_until(shows_held, timeout=20, message="the paused key's event held")
        expect(page.locator("tr.waiting-key", has_text="order:1")).to_contain_text("paused since")
        assert str(held) not in delivered(relay)
        page.locator("tr.waiting-key", has_text="order:1").get_by_role("button", name="Resume").click()
        page.get_by_role("button", name="Yes, do it").click()
        expect(page.locator("p.done-result")).to_contain_text("1 held event(s) due now")
        wait_until(lambda: str(held) in delivered(relay), timeout=20, message="the resumed key's event delivered")

        # The hostile event's own page: key, type, header and payload as text.
        page.goto(f"{console_url}/events?id={hostile}")
        expect(page.locator("dd.key")).to_contain_text(SCRIPT)
        expect(page.locator("dd.type")).to_have_text(IMG)
        expect(page.locator("pre.payload")).to_contain_text(IMG)
        expect(page.locator("pre.headers")).to_contain_text(IMG)
        assert page.locator("img").count() == 0

        # The overview's charts, with an hour of samples as a console running that long would have stored
        # (this relay ran for seconds): a backlog that built up behind a stuck key and drained.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SEED_SAMPLES, {"sink": SINK})
        page.goto(console_url + "/")
        expect(page.locator("svg.plot").first).to_be_visible()
        assert page.locator("svg.plot polyline").count() >= 3
        page.screenshot(path=str(images / "console-overview.png"))

        page.goto(f"{console_url}/audit")
        expect(page.locator("tr.audit-record").first).to_contain_text("Ada (token ops)")
        assert page.locator("tr.audit-record").count() == 3
        page.screenshot(path=str(images / "console-audit.png"))
        browser.close()
    assert dialogs == []  # no script of a producer's ran
    assert not [e for e in errors if "Content Security Policy" in e], errors


def test_the_console_command_serves_the_pages_and_stops_on_sigterm(dsn: str, tmp_path: Path) -> None:
    import urllib.request

    port = free_port()
    script = Path(sys.executable).with_name("outbox-relay")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "outbox_relay.cli"]
    with (tmp_path / "console.out").open("wb") as out:
        process = subprocess.Popen([*command, "console", "--dsn", dsn, "--port", str(port)], stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def page() -> str | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                    return str(r.headers["content-security-policy"]) + r.read().decode()
            except OSError:
                return None

        wait_until(lambda: page() is not None, timeout=30,
                   message=f"the console to answer: {(tmp_path / 'console.out').read_text()[-1000:]}")
        served = page() or ""
        assert "default-src 'self'" in served and "read-only" in served
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0, (tmp_path / "console.out").read_text()[-1000:]
    assert "read-only: no --token-file" in (tmp_path / "console.out").read_text()
