"""The shape every service of a relay process shares: one named thread, started and stopped by the worker."""

from __future__ import annotations

import threading


class ServiceThread:
    """A loop on a thread of its own (named ``name``: logs and tests tell the threads apart by it).

    ``stop`` asks the loop to end at its next check and returns at once; ``join`` waits for it."""

    name = "service"

    def __init__(self) -> None:
        self.stopped = threading.Event()  # set by stop(): the loop ends at its next check
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self) -> None:
        raise NotImplementedError
