"""Which rebuild this process runs (rebuild.py), so that a rebuild whose row disappears while it runs can be
told apart: switched in by a peer (another ``rebuild`` process), cancelled, or restarted."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from outbox_relay.sqlfiles import query

from .rebuild_error import RebuildError
from .rebuild_tables import LiveTable, table_oid

log = logging.getLogger("outbox_relay.rebuild")


@dataclass(frozen=True)
class RunningRebuild:
    """A rebuild's row as this process started or resumed it: its start time (a restart makes a new row)
    and the oids of its copies (after a peer's switch-over, the live tables are those copies)."""

    projection: str
    sink: str
    started_at: datetime
    tables: tuple[LiveTable, ...]
    copies: tuple[int | None, ...]

    @classmethod
    def remember(cls, conn: psycopg.Connection[Any], row: Sequence[Any], tables: Sequence[LiveTable],
                 shadow: str) -> RunningRebuild:
        """From its ``outbox.rebuilds`` row (rebuild.sql ``get``), in the start's transaction."""
        return cls(row[0], row[1], row[6], tuple(tables), tuple(table_oid(conn, shadow, t.name) for t in tables))

    def still_running(self, conn: psycopg.Connection[Any]) -> bool:
        """True while ``outbox.rebuilds`` holds this rebuild; False if a peer switched its copies in (the live
        tables are those copies now); raises RebuildError if it was cancelled, its sink dropped, or it was
        restarted by another process."""
        row = conn.execute(query("rebuild", "get"), {"projection": self.projection}).fetchone()
        if row is not None and row[6] == self.started_at:
            return True
        if row is not None:
            raise RebuildError(f"the rebuild of {self.projection!r} was restarted by another process (rebuild "
                               "--restart) while this one ran: this one stops, the new one carries on")
        live = tuple(table_oid(conn, t.schema, t.name) for t in self.tables)
        if live == self.copies:
            log.info("rebuild %s: another rebuild process switched over already", self.projection)
            return False
        raise RebuildError(
            f"the rebuild of {self.projection!r} was cancelled while it ran (`rebuild --cancel`, or its sink "
            f"{self.sink!r} was dropped): nothing was switched over, the live model is unchanged; run the rebuild "
            "again to start over")
