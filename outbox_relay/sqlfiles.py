"""Named queries from the ``.sql`` files, parsed once.

Each file holds blocks that start with ``-- name: <query>`` followed by a one-line purpose.
The files live in the repository's top-level ``sql/`` folder; wheels carry a copy as
``outbox_relay/_sql``.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def sql_dir() -> Path:
    packaged = Path(__file__).parent / "_sql"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "sql"


@functools.cache
def queries(group: str) -> dict[str, str]:
    """All named queries of ``sql/queries/<group>.sql``, compacted (``compact``)."""
    text = (sql_dir() / "queries" / f"{group}.sql").read_text()
    parts = _NAME.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {name: compact(body) for name, body in zip(parts[1::2], parts[2::2], strict=True)}


_TOKEN = re.compile(r"""
    (?P<comment>--[^\n]*)
  | (?P<block>/\*.*?\*/)
  | (?P<space>\s+)
  | (?P<literal>'(?:[^']|'')*'|"(?:[^"]|"")*")
  | (?P<dollar>(\$(?:[A-Za-z_][A-Za-z_0-9]*)?\$).*?\6)
  | (?P<other>[^-/\s'"$]+|.)
""", re.VERBOSE | re.DOTALL)


def compact(sql: str) -> str:
    """The statement without its comments and indentation, but for the first line when it is the
    query's one-line purpose (it shows in pg_stat_activity and the server's log).

    Why: psycopg caches the conversion of a query's ``%(name)s`` placeholders only for queries of up
    to 4 KB (psycopg._queries.MAX_CACHED_STATEMENT_LENGTH); the relay's read and checkpoint and the
    producers' publish, with their comments, were longer and were parsed again on every execution
    (a checkpoint cost 0.23 ms of client CPU, compacted 0.17). String literals, quoted identifiers
    and dollar-quoted bodies stay as they are."""
    sql = sql.strip()
    first, _, rest = sql.partition("\n")
    purpose = first + "\n" if first.startswith("--") else ""
    body = rest if purpose else sql
    out: list[str] = []
    for m in _TOKEN.finditer(body):
        kind = m.lastgroup
        if kind in ("comment", "block"):
            continue
        if kind == "space":
            if out and not out[-1].isspace():
                out.append("\n" if "\n" in m.group() else " ")
            continue
        out.append(m.group())
    return purpose + "".join(out).strip()


def query(group: str, name: str) -> str:
    return queries(group)[name]
