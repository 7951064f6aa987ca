"""A sink event that kills the relay process, restarted the way a supervisor does it (Kubernetes,
systemd: at once, with the same --worker-id). Each death is charged from the first one, so the event is
dead-lettered after about --max-attempts deaths, not 2N+ (it took 6-9 at --max-attempts 3)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.relay_helpers import dead_letters, publish

pytestmark = pytest.mark.slow

COMMAND = Path(sys.executable).with_name("outbox-relay")
FAST = ["--heartbeat-seconds", "0.5", "--worker-ttl-seconds", "3", "--housekeeping-seconds", "0.5",
        "--poll-seconds", "0.2", "--lease-seconds", "10", "--backoff-base-seconds", "0.05",
        "--backoff-max-seconds", "0.05"]

KILLER = '''
import os
from pathlib import Path

class Killer:
    name = "killer"
    kind = "killer"

    def deliver(self, event):
        if event.payload_json and '"kill"' in event.payload_json:
            os._exit(17)  # what a segfault in a C extension or the OOM killer looks like to the relay
        with open(os.environ["DELIVERED_LOG"], "a") as f:
            f.write(str(event.id) + "\\n")
'''


@pytest.mark.parametrize("max_attempts", [3, 5])
def test_a_process_killing_event_costs_about_max_attempts_deaths_with_a_stable_worker_id(
        dsn: str, tmp_path: Path, max_attempts: int) -> None:
    (tmp_path / "killer_sink.py").write_text(KILLER)
    delivered = tmp_path / "delivered.log"
    env = {**os.environ, "OUTBOX_DSN": dsn, "DELIVERED_LOG": str(delivered), "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    ids = publish(dsn, [("k", "t", {"n": 1}), ("k", "t", {"kill": True}), ("k", "t", {"n": 3}),
                        *[(f"other-{i}", "t", {"n": i}) for i in range(20)]], topic="t")
    poison = ids[1]
    deaths = 0
    deadline = time.monotonic() + 240
    log = tmp_path / "relay.stderr"
    while poison not in dead_letters(dsn, "killer"):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        assert deaths <= 3 * max_attempts, f"{deaths} deaths and still not dead-lettered"
        with log.open("ab") as err:
            relay = subprocess.Popen([str(COMMAND), "run", "--worker-id", "stable", "--no-kafka", "--sink",
                                      "killer_sink:Killer", "--max-attempts", str(max_attempts), *FAST],
                                     cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=err)
        try:
            while relay.poll() is None and poison not in dead_letters(dsn, "killer"):
                time.sleep(0.1)
            if relay.poll() is not None:
                assert relay.returncode == 17, log.read_text()[-3000:]
                deaths += 1
        finally:
            if relay.poll() is None:
                relay.terminate()
                relay.wait(60)
    # Charged from the first death: max_attempts deaths, or max_lapses (3) + 2 when that is more (the
    # first deaths can not tell which event of a batch killed the process, and an innocent event ahead of
    # it in the bucket is probed alone first), never the 2N+ of a count that began after the lapses.
    assert deaths <= max(max_attempts, 3 + 2), f"{deaths} deaths at --max-attempts {max_attempts}"
    assert dead_letters(dsn, "killer")[poison][0] >= 1
    got = delivered.read_text().split() if delivered.exists() else []
    assert str(ids[2]) in got and str(ids[0]) in got and str(poison) not in got
