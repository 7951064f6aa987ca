"""This relay's entry in the registry (``outbox.workers``): its id, claimed at start, left at the end."""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import uuid

from psycopg_pool import ConnectionPool

from .. import __version__, store
from ..errors import ConfigurationError, WorkerIdInUse
from ..hosts import pid_alive
from ..migrate import latest_version
from ..settings import RelaySettings
from ..store import Conn

log = logging.getLogger("outbox_relay.worker")

# Worker ids registered by the workers of this process ((dsn, id) -> instance), so that a second Worker
# given the same id for the same database (two ``Relay`` objects left with the default, per-process id)
# is refused at its start instead of being taken for a previous run of this process and taking the
# registration over.
_ids_lock = threading.Lock()
_ids_in_process: dict[tuple[str, str], str] = {}


@functools.cache
def schema_version() -> int:
    """The schema version this code was written for (the newest shipped migration)."""
    return latest_version()


class Registration:
    """One relay's registration under its worker id."""

    def __init__(self, settings: RelaySettings) -> None:
        self.settings = settings
        self.id = settings.worker_id
        # This process's registration under self.id (workers.metadata): a second relay given the same
        # --worker-id is told apart from this one, and from a previous run of this one (claim).
        self.instance = uuid.uuid4().hex

    def metadata(self, listening: bool | None, watching: bool) -> dict[str, object]:
        """What a heartbeat records: who this relay process is, and the TTL the others judge it by."""
        # schema_version: the schema this code was written for (partition_hold_v1 keeps what older relays need).
        return {"version": __version__, "schema_version": schema_version(), "host": socket.gethostname(),
                "pid": os.getpid(), "instance": self.instance,
                "ttl_seconds": self.settings.worker_ttl_seconds, "listening": listening, "watching": watching}

    def claim(self, conn: Conn, sinks: list[str], metadata: dict[str, object]) -> None:
        """Register under self.id, or raise WorkerIdInUse: another relay process holds it with a fresh
        heartbeat. A registration on this host whose pid is gone, or is this process's own pid (a
        container's pid 1), is a previous run's (a crash, a restart): taken over at once."""
        ttl = self.settings.worker_ttl_seconds
        with _ids_lock:
            if _ids_in_process.setdefault(self._key(), self.instance) != self.instance:
                raise ConfigurationError(f"worker id {self.id!r} is used by another Relay in this process: give each "
                                         "relay member its own worker_id (RelaySettings(worker_id=...))")
        try:
            store.heartbeat(conn, self.id, "alive", sinks, metadata, ttl)
            return
        except WorkerIdInUse as exc:
            if exc.host != socket.gethostname() or (exc.pid is not None and exc.pid != os.getpid()
                                                    and pid_alive(exc.pid)):
                store.record_clash(conn, self.id, socket.gethostname(), os.getpid())
                raise
            log.warning("worker id %s: taking over the registration of a previous run on this host (pid %s, "
                        "heard from %.1fs ago)", self.id, exc.pid, exc.seen_seconds_ago)
        store.heartbeat(conn, self.id, "alive", sinks, metadata, ttl, take_over=True)

    def forget(self) -> None:
        """Let another Worker of this process use the id (this one ends, or never started)."""
        with _ids_lock:
            if _ids_in_process.get(self._key()) == self.instance:
                del _ids_in_process[self._key()]

    def leave(self, pool: ConnectionPool[Conn] | None) -> None:
        self.forget()
        if pool is None:
            return
        try:
            with pool.connection(timeout=5.0) as conn:
                store.leave(conn, self.id, self.instance)
        except Exception as exc:
            log.warning("could not leave the registry (%s); housekeeping will mark this worker dead", exc)

    def _key(self) -> tuple[str, str]:
        return self.settings.dsn.get_secret_value(), self.id
