"""The grants blocks of docs/roles.md (schema outbox) and docs/inbox.md ("Roles",
schema outbox_inbox), generated from outbox_relay/privileges.py.

    python scripts/grants_sql.py            # print the SQL (both blocks)
    python scripts/grants_sql.py --write    # replace them in the docs
    python scripts/grants_sql.py --check    # exit 1 if a page is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from outbox_relay.privileges import INBOX, OUTBOX, grants_sql

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = {OUTBOX: DOCS / "roles.md", INBOX: DOCS / "inbox.md"}
BEGIN, END = "<!-- grants:begin -->", "<!-- grants:end -->"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = 0
    for schema, page in PAGES.items():
        generated = grants_sql(schema)
        if not (args.write or args.check):
            print(f"-- {page.name}\n{generated}")
            continue
        text = page.read_text()
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        updated = f"{head}{BEGIN}\n```sql\n{generated}```\n{END}{tail}"
        if args.check and updated != text:
            print(f"{page} is stale: run python scripts/grants_sql.py --write", file=sys.stderr)
            stale = 1
        elif args.write:
            page.write_text(updated)
    return stale


if __name__ == "__main__":
    sys.exit(main())
