"""CPU starvation as a fault: every relay process is duty-cycled with SIGSTOP/SIGCONT, so that it runs
only a fraction of the time (25 % run, 75 % stopped, in periods of 100-200 ms by default), as on a
host whose cores are overcommitted or a container held to a CPU quota. It needs no cgroup privileges.

It runs in a thread of its own for its whole length while the load and the other faults go on:
``Starver.start`` returns at once. A relay that another fault holds stopped (``relay_stop``) is left
alone until that fault sends its SIGCONT; relays started meanwhile (after a kill or a deploy) are
starved from their first period on.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time

from tests.faults.cluster import Fleet

# The periods' length is drawn per period from this range (seconds): shorter than a heartbeat
# (0.5 s in the suite), so that what suffers is the work done per second, not one long pause.
PERIOD_RANGE = (0.1, 0.2)


class Starver:
    """Duty-cycles the fleet's relays for ``seconds``: each period they run ``duty`` of it."""

    def __init__(self, fleet: Fleet, rnd: random.Random, lock: threading.Lock, paused: set[int],
                 seconds: float, duty: float) -> None:
        if not 0.0 < duty <= 1.0:
            raise ValueError(f"duty must be in (0, 1], not {duty}")
        self.fleet, self.rnd, self.lock, self.paused = fleet, rnd, lock, paused
        self.seconds, self.duty = seconds, duty
        self.periods = 0
        self.ends_at = 0.0  # epoch seconds, once started
        self._thread = threading.Thread(target=self._run, name="faults-starve", daemon=True)

    def start(self) -> Starver:
        self.ends_at = time.time() + self.seconds
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _send(self, sig: signal.Signals) -> None:
        with self.lock:
            for slot, relay in list(self.fleet.relays.items()):
                if slot in self.paused or not relay.running:
                    continue
                with contextlib.suppress(OSError):  # it may exit between the check and the signal
                    relay.proc.send_signal(sig)

    def _run(self) -> None:
        deadline = time.monotonic() + self.seconds
        try:
            while time.monotonic() < deadline:
                period = self.rnd.uniform(*PERIOD_RANGE)
                time.sleep(period * self.duty)  # running
                if self.duty < 1.0:
                    self._send(signal.SIGSTOP)
                    time.sleep(period * (1.0 - self.duty))
                    self._send(signal.SIGCONT)
                self.periods += 1
        finally:
            self._send(signal.SIGCONT)
