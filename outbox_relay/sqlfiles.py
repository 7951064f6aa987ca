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
    """All named queries of ``sql/queries/<group>.sql``."""
    text = (sql_dir() / "queries" / f"{group}.sql").read_text()
    parts = _NAME.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def query(group: str, name: str) -> str:
    return queries(group)[name]
