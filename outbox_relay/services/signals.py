"""SIGTERM/SIGINT for a relay that owns its process (``outbox-relay run``): the first drains, the second stops hard."""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable
from types import FrameType

log = logging.getLogger("outbox_relay.worker")


def _ignore(_signum: int, _frame: FrameType | None) -> None:
    """The Python-level handler of SIGTERM/SIGINT: nothing (``SignalWatch``)."""


class SignalWatch:
    """The ``signals`` thread: acts on SIGTERM/SIGINT, ``drain`` for the first, ``stop_hard`` after.

    The Python handlers do nothing: one runs on the main thread between two bytecodes, possibly
    inside a lock the main thread holds (``Event.set`` in the first signal's own handling), and
    taking that lock again deadlocks: a second signal 1 ms after the first hung the relay for good.
    The C handler writes each signal's number to a socket (``signal.set_wakeup_fd``); the
    ``signals`` thread reads it and acts. Installed from the main thread only, once per process:
    the sockets stay open for the life of the process."""

    def __init__(self, draining: threading.Event, drain: Callable[[], None], stop_hard: Callable[[], None]) -> None:
        self._draining = draining  # set: the next signal stops hard
        self._drain = drain
        self._stop_hard = stop_hard
        self._sockets: tuple[socket.socket, socket.socket] | None = None

    def install(self) -> None:
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.fileno())
        self._sockets = (reader, writer)  # open for the life of the process
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _ignore)
        threading.Thread(target=self._run, args=(reader,), name="signals", daemon=True).start()

    def _run(self, reader: socket.socket) -> None:
        while data := reader.recv(64):
            for signum in data:
                if signum not in (signal.SIGTERM, signal.SIGINT):
                    continue
                if self._draining.is_set():
                    log.warning("second %s: stopping hard", signal.Signals(signum).name)
                    self._stop_hard()
                else:
                    log.info("%s: draining", signal.Signals(signum).name)
                    self._drain()
