"""The real `outbox-relay run --sink MODULE:ATTR` with the example sink of docs/writing-a-sink.md
(examples/jsonl_sink.py): it delivers every event in order per key, drains on SIGTERM, exits 0; a
--sink that names nothing importable is one clear line and exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.relay_helpers import publish
from tests.servers import wait_until

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FAST = ["--heartbeat-seconds", "0.5", "--worker-ttl-seconds", "2", "--housekeeping-seconds", "0.5",
        "--poll-seconds", "0.2"]


def command() -> list[str]:
    script = Path(sys.executable).with_name("outbox-relay")  # the installed console script
    return [str(script)] if script.exists() else [sys.executable, "-m", "outbox_relay.cli"]


def start(dsn: str, tmp_path: Path, *args: str, path: str = str(EXAMPLES)) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OUTBOX_DSN": dsn, "PYTHONPATH": path,
           "AUDIT_LOG_PATH": str(tmp_path / "audit.jsonl"), "PYTHONUNBUFFERED": "1"}
    with (tmp_path / "relay.stderr").open("wb") as err:
        return subprocess.Popen([*command(), "run", "--worker-id", "acceptance", *FAST, *args], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)


def lines(tmp_path: Path) -> list[dict[str, object]]:
    """The log's events. A SIGKILL in the middle of a write can tear the last line (a write that crosses a
    page is cut where the kill lands); the sink ends such a line before it appends again, so at most one
    line is not JSON, and more than one fails the test."""
    path = tmp_path / "audit.jsonl"
    if not path.exists():
        return []
    events, torn = [], []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            torn.append(line)
    assert len(torn) <= 1, f"{len(torn)} lines of the log are not JSON: {torn[:3]}"
    return events


def test_run_with_the_example_sink_delivers_in_order_and_drains(dsn: str, tmp_path: Path) -> None:
    keys = [f"order:{i % 5}" for i in range(50)]
    relay = start(dsn, tmp_path, "--no-kafka", "--sink", "jsonl_sink:make_sink")
    try:
        ids = publish(dsn, [(k, "OrderPlaced", {"n": n}) for n, k in enumerate(keys)])
        wait_until(lambda: len({line["id"] for line in lines(tmp_path)}) == 50, timeout=30,
                   message=f"every event in the log; stderr: {(tmp_path / 'relay.stderr').read_text()[-2000:]}")

        def backlog() -> dict[str, dict[str, object]]:
            status = subprocess.run([*command(), "status", "--json"], env={**os.environ, "OUTBOX_DSN": dsn},
                                    capture_output=True, text=True, timeout=60)
            assert status.returncode == 0, status.stderr
            return {row["sink"]: row for row in json.loads(status.stdout)["backlog"]}

        assert backlog()["audit-log"]["kind"] == "jsonl"
        # The stored cursor (what status reads) trails delivery by up to --cursor-flush-seconds (5).
        wait_until(lambda: backlog()["audit-log"]["pending"] == 0, timeout=20, interval=1,
                   message="status to show nothing pending")
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(30) == 0, (tmp_path / "relay.stderr").read_text()[-2000:]
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait(10)
    got = lines(tmp_path)
    for key in set(keys):
        first_seen: list[str] = []
        for line in got:
            if line["key"] == key and line["id"] not in first_seen:
                first_seen.append(str(line["id"]))
        assert first_seen == [str(i) for i, k in zip(ids, keys, strict=True) if k == key]
    assert {line["id"]: line["payload"] for line in got}[str(ids[7])] == {"n": 7}  # the stored JSON, as is
    assert all(line["type"] == "OrderPlaced" for line in got)


def test_run_with_a_sink_module_that_is_not_there_is_one_clear_line(dsn: str, tmp_path: Path) -> None:
    relay = start(dsn, tmp_path, "--no-kafka", "--sink", "jsonl_sinks:make_sink")
    code = relay.wait(60)
    err = (tmp_path / "relay.stderr").read_text()
    assert code == 2, err
    assert "--sink jsonl_sinks:make_sink: no module named 'jsonl_sinks'" in err and "Traceback" not in err, err


def test_a_relay_killed_mid_stream_loses_nothing_and_reorders_nothing(dsn: str, tmp_path: Path) -> None:
    keys = [f"order:{i % 20}" for i in range(3000)]
    ids = publish(dsn, [(k, "OrderPlaced", {"n": n}) for n, k in enumerate(keys)])
    relay = start(dsn, tmp_path, "--no-kafka", "--sink", "jsonl_sink:make_sink", "--batch-size", "100")
    try:
        wait_until(lambda: len(lines(tmp_path)) >= 300, timeout=30, message="the first events in the log")
        relay.kill()  # SIGKILL: batches in flight were written to the log but not checkpointed
        relay.wait(10)
        assert len({line["id"] for line in lines(tmp_path)}) < 3000, "killed before the end"
        relay = start(dsn, tmp_path, "--no-kafka", "--sink", "jsonl_sink:make_sink", "--worker-id", "acceptance-2")
        wait_until(lambda: len({line["id"] for line in lines(tmp_path)}) == 3000, timeout=60,
                   message="every event in the log after the restart")
    finally:
        if relay.poll() is None:
            relay.send_signal(signal.SIGTERM)
            relay.wait(30)
    got = lines(tmp_path)
    for key in set(keys):
        first_seen: list[str] = []
        for line in got:
            if line["key"] == key and line["id"] not in first_seen:
                first_seen.append(str(line["id"]))
        assert first_seen == [str(i) for i, k in zip(ids, keys, strict=True) if k == key], key


CRASHER = '''
import os

class Crasher:
    name, kind = "crasher", "crasher"

    def __init__(self):
        self.path = os.environ["AUDIT_LOG_PATH"]

    def deliver(self, event):
        if event.payload["n"] == 5:
            os._exit(1)  # the whole process dies on this event, every time
        with open(self.path, "a") as log:
            log.write(event.payload_json + "\\n")

sink = Crasher()
'''


def test_a_sink_that_kills_its_process_on_one_event_gets_it_dead_lettered(dsn: str, tmp_path: Path) -> None:
    (tmp_path / "crasher.py").write_text(CRASHER)
    publish(dsn, [("poison", "t", {"n": n}) for n in range(10)] + [("other", "t", {"n": 100})])
    args = ["--no-kafka", "--sink", "crasher:sink", "--max-lapses", "1", "--max-attempts", "2", "--lease-seconds", "2"]

    def dead() -> list[tuple[object, ...]]:
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as conn:
            return conn.execute("SELECT attempts, last_error FROM outbox.dead_letters "
                                "WHERE sink = 'crasher'").fetchall()

    restarts = 0
    relay: subprocess.Popen[bytes] | None = None
    deadline = time.monotonic() + 120
    try:
        while not dead():  # a supervisor: start the relay again whenever it died
            assert time.monotonic() < deadline, f"the poison event was not isolated after {restarts} restarts"
            if relay is None or relay.poll() is not None:
                relay = start(dsn, tmp_path, *args, "--worker-id", f"crash-{restarts}", path=str(tmp_path))
                restarts += 1
            time.sleep(0.2)
        wait_until(lambda: {json.loads(line)["n"] for line in (tmp_path / "audit.jsonl").read_text().splitlines()}
                   == {0, 1, 2, 3, 4, 6, 7, 8, 9, 100}, timeout=30, message="the rest delivered")
    finally:
        if relay is not None and relay.poll() is None:
            relay.send_signal(signal.SIGTERM)
            relay.wait(30)
    [(attempts, error)] = dead()
    # Its attempts count the deaths charged to it from the first (crash-loop isolation), at least max-attempts.
    assert 2 <= int(str(attempts)) <= restarts and "stopped while delivering this event alone" in str(error)
    got = [json.loads(line)["n"] for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    poison = [n for n in got if n < 100]
    assert list(dict.fromkeys(poison)) == [0, 1, 2, 3, 4, 6, 7, 8, 9] and 100 in got


def test_the_example_sink_ends_a_line_a_crash_tore_before_it_appends(tmp_path: Path) -> None:
    """A log whose last line a kill tore (no newline): the next process's first line starts on a line of its
    own, so a reader loses only the torn line (whose events come again), not the next one with it."""
    import datetime as dt
    import importlib.util
    import uuid

    from outbox_relay.sinks import Delivered, SinkEvent

    spec = importlib.util.spec_from_file_location("jsonl_sink_example", EXAMPLES / "jsonl_sink.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    log = tmp_path / "audit.jsonl"
    log.write_text('{"id": "1", "key": "k"}\n{"id": "2", "ke')  # torn by the kill
    event = SinkEvent(id=uuid.uuid4(), topic=None, key="k", type="t", payload_json='{"n": 3}', headers={},
                      time=dt.datetime.now(dt.UTC), version=1, attempt=1)
    sink = module.JsonLinesSink(log)
    assert isinstance(sink.deliver(event), Delivered)
    assert isinstance(sink.deliver(event), Delivered)
    assert log.read_text().splitlines()[1] == '{"id": "2", "ke', "the torn line ended, left as it was"
    assert [json.loads(line)["id"] for line in log.read_text().splitlines()[2:]] == [str(event.id)] * 2
    assert [e["id"] for e in lines(tmp_path)] == ["1", str(event.id), str(event.id)]
