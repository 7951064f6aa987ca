"""One run of an inbox consumer process: its incarnation, and what it makes of the run registered before
it under the same member id.

A lease belongs to a run, not to a member id: a consumer restarted with the same ``--member-id`` (a
StatefulSet pod, a systemd unit, a restart after the OOM killer) must not renew the leases of the run
before it, which nobody consumes. That run's are claimed at once when it is known to be over (on this
host, its pid gone), else when their leases run out."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Any

from ..hosts import pid_alive

log = logging.getLogger("outbox_relay.inbox")


class Run:
    """This run of the process under ``member``. Only the consumer's thread touches it."""

    def __init__(self, consumer: str, member: str, lease_seconds: float) -> None:
        self.consumer, self.member, self.lease_seconds = consumer, member, lease_seconds
        self.incarnation = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.gone: str | None = None  # the previous run's incarnation, known to be over: claimed at once
        self._joined = False
        self._clash: tuple[str | None, int | None] | None = None  # another live process using the member id

    def params(self) -> dict[str, Any]:
        """The parameters of the join, leave, renew and claim queries."""
        return {"consumer": self.consumer, "member": self.member, "host": self.host, "pid": os.getpid(),
                "incarnation": self.incarnation, "gone": self.gone}

    def joined(self, before: tuple[str | None, str | None, int | None, float] | None) -> None:
        """A join went through; ``before``: the other run registered under the member id until then
        (incarnation, host, pid, seconds since it was heard from), if any."""
        if before is not None:
            self._another_run(*before)
        self._joined = True

    def _another_run(self, incarnation: str | None, host: str | None, pid: int | None, silent: float) -> None:
        if self._joined:  # it registered after this run did: alive, with the same id
            if (host, pid) == self._clash:
                return  # said once; the two keep overwriting the registration
            self._clash = (host, pid)
            log.error("member id %s is also used by another live process (host %s, pid %s): give each process its "
                      "own --member-id; each applies only the partitions it claimed", self.member, host, pid)
            return
        if incarnation is not None and host == self.host and pid is not None and (pid == os.getpid()
                                                                                  or not pid_alive(pid)):
            # Its pid is gone from this host, or is ours (a container's pid 1): that run is over.
            self.gone = incarnation
            log.warning("member id %s: the previous run on this host (pid %s, heard from %.1fs ago) stopped without "
                        "releasing its partitions: they are claimed now, each applied carefully", self.member, pid,
                        silent)
        elif silent < self.lease_seconds:
            log.warning("member id %s was used by a process on %s (pid %s) heard from %.1fs ago: the partitions it "
                        "holds are claimed when their leases run out (within %gs), unless it renews them (then "
                        "two processes share this id: give each its own --member-id)", self.member, host, pid,
                        silent, self.lease_seconds - silent)
