"""The console's audit records (outbox.console_audit): who did what, when, to how many events."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from ..errors import ConfigurationError
from .table import Conn, Table, fetch_table

AUDIT_LIMIT = (1, 500)
TEXT_LIMIT = 2000  # a target or reason longer than this is cut (a selection of many event ids)


@dataclass(frozen=True)
class AuditRecord:
    id: int
    at: datetime


def record_action(conn: Conn, *, who: str, action: str, sink: str | None, target: str, count: int,
                  refused: str | None = None) -> AuditRecord:
    """Write one audit record: run it in the action's transaction, so that a committed action has one."""
    if not who.strip() or not action:
        raise ConfigurationError("an audit record names who and what")
    row = fetch_table(conn, "audit_record", {"who": who[:200], "action": action, "sink": sink,
                                             "target": target[:TEXT_LIMIT], "count": count,
                                             "refused": None if refused is None else refused[:TEXT_LIMIT]},
                      group="console").rows[0]
    return AuditRecord(id=row[0], at=row[1])


def audit_log(conn: Conn, *, limit: int = 100, before: int | None = None) -> Table:
    """Audit records newest first; ``before``: the id of the last record of the previous page."""
    low, high = AUDIT_LIMIT
    if not low <= limit <= high:
        raise ConfigurationError(f"a page of audit records holds {low}-{high}, not {limit}")
    return fetch_table(conn, "audit_page", {"before": before, "limit": limit}, group="console")
