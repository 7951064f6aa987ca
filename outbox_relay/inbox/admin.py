"""Operator actions on the inbox as a library (``cli.py`` only parses and prints)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..errors import OutboxError
from ..sqlfiles import query


def list_dead_letters(conn: psycopg.Connection[Any], consumer: str, *, topic: str | None = None,
                      after: int | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """Newest first; ``after``: the last id of the previous page."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query("inbox", "list_dead_letters"),
                           {"consumer": consumer, "topic": topic, "after": after, "limit": limit}).fetchall()


def show_dead_letter(conn: psycopg.Connection[Any], consumer: str, ident: int) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(query("inbox", "show_dead_letter"), {"consumer": consumer, "id": ident}).fetchone()
    if row is None:
        raise OutboxError(f"no dead letter {ident} of consumer {consumer!r}")
    return row


def request_retry(conn: psycopg.Connection[Any], consumer: str, ids: Sequence[int] | None) -> list[int]:
    """Ask the running consumers to apply these dead letters again (``None``: all of the consumer's);
    returns the ids found. Each is applied once in its own transaction, deduplicated by its ce_id."""
    return _ids(conn, "request_retry", consumer, ids)


def drop_dead_letters(conn: psycopg.Connection[Any], consumer: str, ids: Sequence[int] | None) -> list[int]:
    """Delete dead letters for good (``None``: all of the consumer's); returns the ids deleted."""
    return _ids(conn, "drop_dead_letters", consumer, ids)


def _ids(conn: psycopg.Connection[Any], name: str, consumer: str, ids: Sequence[int] | None) -> list[int]:
    with conn.transaction():
        found = sorted(r[0] for r in conn.execute(query("inbox", name),
                                                  {"consumer": consumer, "ids": list(ids) if ids else None}))
        missing = sorted(set(ids or ()) - set(found))
        if missing:  # raised inside the transaction: nothing of a partly wrong command is done
            raise OutboxError(f"no dead letter {', '.join(map(str, missing))} of consumer {consumer!r}")
    return found


def positions(conn: psycopg.Connection[Any], consumer: str) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query("inbox", "positions"), {"consumer": consumer}).fetchall()
