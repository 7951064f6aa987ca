"""The configuration reference of docs/configuration.md, generated from RelaySettings.

    python scripts/settings_table.py            # print the table
    python scripts/settings_table.py --write    # replace it in docs/configuration.md
    python scripts/settings_table.py --check    # exit 1 if docs/configuration.md is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic_core import PydanticUndefined

from outbox_relay.settings import ENV_PREFIX, bounds, listed_fields
from outbox_relay.settings_base import environment_only

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def _default(name: str, field: Any) -> str:
    if field.default_factory is not None:
        if name == "worker_id":
            return "host-pid"
        empty = field.default_factory()
        return "" if not empty and isinstance(empty, list) else f"`{empty}`"
    value = field.default
    if field.is_required():
        return "**required**"
    if value is PydanticUndefined or value is None:
        return ""  # an empty cell: no default
    if hasattr(value, "get_secret_value"):
        value = value.get_secret_value()
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int | float) else f"`{value}`"


def _flag(name: str, field: Any) -> str:
    """The option, and its variable where it is not the option's name (``--a-b`` is ``OUTBOX_A_B``)."""
    env = f"`{ENV_PREFIX}{name.upper()}`"
    if name == "kafka_config":  # the meaning says what @PATH does
        return f"`--kafka-option KEY=VALUE` (repeatable); {env} (JSON object)"
    if name in ("projection", "sink"):  # the meaning says how the variable separates them
        return f"`--{name} {'NAME' if name == 'projection' else 'MODULE:ATTR'}`"
    if environment_only(field):
        return env if "environment only" in (field.description or "") else f"{env} (environment only)"
    flag = "--" + name.replace("_", "-")
    if field.annotation is bool:
        return f"`{flag}` / `--no-{name.replace('_', '-')}`"
    return f"`{flag}`"


def _default_and_bounds(name: str, field: Any) -> str:
    # Numeric bounds only: a length limit (a URL's 4096 characters) says nothing a user needs here, and a
    # value past it is refused naming the option.
    default, allowed = _default(name, field), bounds(field) or ""
    if allowed.endswith(" characters"):
        allowed = ""
    return f"{default} ({allowed})" if default and allowed else default or (allowed and f"({allowed})")


def _meaning(name: str, field: Any) -> str:
    """The field's description without a ``webhook:`` style prefix that the option's own name already says."""
    text = field.description or ""
    head, sep, rest = text.partition(": ")
    return rest if sep and head.isidentifier() and name.startswith(head + "_") else text


def table() -> str:
    lines = ["| option | default (allowed) | meaning |", "|---|---|---|"]
    for name, field in listed_fields().items():
        lines.append(f"| {_flag(name, field)} | {_default_and_bounds(name, field)} | {_meaning(name, field)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args()
    generated = table()
    if not (args.write or args.check):
        print(generated)
        return 0
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    updated = f"{head}{BEGIN}\n{generated}\n{END}{tail}"
    if args.check:
        if updated != text:
            print(f"{DOC} is stale: run python scripts/settings_table.py --write", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
