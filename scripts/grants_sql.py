"""The grants block of docs/operations.md ("Least-privilege roles"), generated from outbox_relay/privileges.py.

    python scripts/grants_sql.py            # print the SQL
    python scripts/grants_sql.py --write    # replace it in docs/operations.md
    python scripts/grants_sql.py --check    # exit 1 if docs/operations.md is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from outbox_relay.privileges import grants_sql

DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
BEGIN, END = "<!-- grants:begin -->", "<!-- grants:end -->"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args()
    generated = grants_sql()
    if not (args.write or args.check):
        print(generated, end="")
        return 0
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    updated = f"{head}{BEGIN}\n```sql\n{generated}```\n{END}{tail}"
    if args.check:
        if updated != text:
            print(f"{DOC} is stale: run python scripts/grants_sql.py --write", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
