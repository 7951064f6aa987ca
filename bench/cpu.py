"""Where a case's CPU time goes: CPU seconds of groups of processes over a window, from /proc (Linux).

A latency window on 2 cores is often bound by CPU rather than by any one wait: the relays, the
database's backends and the broker share the cores with the bench's own producer and consumer. The
shares (of one core, averaged over the window) say which of them grew when a figure did.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 if it is gone)."""
    fields = _stat(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / TICK


def children(ppid: int) -> list[int]:
    """The processes whose parent is ``ppid`` (a postmaster's backends and helpers)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and int(fields[1]) == ppid:
                out.append(int(entry))
    return out


def postmaster_pid(data_root: Path) -> int | None:
    """The postmaster of the server whose data directory is at or under ``data_root``."""
    for pidfile in [data_root / "postmaster.pid", *data_root.glob("**/postmaster.pid")]:
        try:
            return int(pidfile.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            continue
    return None


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy so far (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK


class CpuWindow:
    """CPU per named group of processes between ``start()`` and ``stop()``. Each group is a callable
    that lists its pids; it is asked at both ends, so processes that start within the window count
    (from zero); those that end within it are missed (stop the window before they end)."""

    def __init__(self, groups: dict[str, Callable[[], Iterable[int]]]) -> None:
        self.groups = groups
        self._start: dict[str, dict[int, float]] = {}
        self._t0 = 0.0
        self._busy0 = 0.0
        self.elapsed = 0.0  # the window's seconds, once stopped (shares x elapsed = CPU seconds)

    def _read(self) -> dict[str, dict[int, float]]:
        return {name: {pid: cpu_seconds(pid) for pid in pids()} for name, pids in self.groups.items()}

    def start(self) -> None:
        self._start = self._read()
        self._t0 = time.monotonic()
        self._busy0 = machine_busy_seconds()

    def stop(self) -> dict[str, float]:
        """Per group, its share of one core over the window (1.0 = a whole core); ``machine`` is all
        cores' busy time, ``other`` what no group accounts for."""
        end = self._read()
        seconds = self.elapsed = max(1e-9, time.monotonic() - self._t0)
        out: dict[str, float] = {}
        for name, readings in end.items():
            before = self._start.get(name, {})
            used = sum(max(0.0, v - before.get(pid, 0.0)) for pid, v in readings.items())
            out[name] = used / seconds
        out["machine"] = (machine_busy_seconds() - self._busy0) / seconds
        out["other"] = max(0.0, out["machine"] - sum(v for k, v in out.items() if k != "machine"))
        return out
