#!/usr/bin/env python3
"""Generate each sync module from its async source (psycopg's ``tools/async_to_sync.py``, smaller).

Every ``X_async.py`` in ``outbox_relay/`` and ``projections/`` is the one source; ``X.py`` next to it
is generated from it and carries a header saying so. ``--check`` (CI, and tests/unit/
test_async_to_sync.py) fails when a generated file differs from what its source gives;
``--write`` rewrites them.

The rewrite works on tokens, so comments and layout survive (``ast.unparse`` would drop comments):
``async``/``await`` go, names in ``RENAMES`` are replaced and ``x_async`` becomes ``x`` (in
docstrings too, as whole words, so they name the sync API), ``Awaitable[T]`` becomes ``T``, and a
block opened by ``if True:  # ASYNC`` is replaced by its ``else:`` block, if any (for the few lines
that differ in more than ``await``: checks, messages). The result is then parsed with ``ast``: any
async construct, ``Async*`` or ``*_async`` name left fails.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("outbox_relay", "projections")

# Async name -> sync name. Applied to every NAME token, and to whole words in strings.
RENAMES = {
    "AsyncConnection": "Connection",
    "AsyncCursor": "Cursor",
    "AsyncSession": "Session",
    "AsyncIterator": "Iterator",
    "AsyncGenerator": "Generator",
    "asyncio": "time",  # asyncio is only imported for asyncio.sleep in the async sources
    "aconn": "conn",
    # the project's own async names; any other name ending in _async loses the suffix (modules too)
    "acheckpoint": "checkpoint",
    "aserver_started": "server_started",
    "apublished": "published",
    "apublish": "publish",
    "aapply_projection": "apply_projection",
    "apsycopg_connection": "psycopg_connection",
    "adrive": "drive",
    "areplay_key": "replay_key",
    "alive_decisions": "live_decisions",
}

HEADER = "# WARNING: generated from {source} by scripts/async_to_sync.py: edit the source, then run\n" \
         "# `python scripts/async_to_sync.py --write`.\n"

_ASYNC_BLOCK = re.compile(r"^(\s*)if True:\s*# ASYNC\s*$")


def _without_async_blocks(text: str) -> str:
    """Replace each ``if True:  # ASYNC`` ... ``else:`` ... block by its else-body, dedented."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _ASYNC_BLOCK.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        indent = m.group(1)
        i += 1
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > len(indent)):
            i += 1
        if i >= len(lines) or lines[i].strip() != "else:" or _indent(lines[i]) != len(indent):
            continue  # no else: nothing of it in the sync module
        i += 1
        body: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > len(indent)):
            body.append(lines[i])
            i += 1
        step = min(_indent(b) for b in body if b.strip()) - len(indent)
        out.extend(b[step:] if b.strip() else b for b in body)
    return "".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _rename_words(text: str) -> str:
    text = re.sub(r"\b(\w+)_async\b(?!\.py)", r"\1", text)  # a file name stays: "x_async.py" is the source
    return re.sub(r"\b(" + "|".join(map(re.escape, RENAMES)) + r")\b", lambda m: RENAMES[m.group(1)], text)


def transform(text: str) -> str:
    """The sync module for the async source ``text``."""
    text = _without_async_blocks(text)
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    lines = text.splitlines(keepends=True)
    # edits: (row, start col, end col, replacement); applied right to left on each line
    edits: list[tuple[int, int, int, str]] = []
    depth_to_drop: list[int] = []
    depth = 0
    signatures: list[int] = []  # tokens starting an `async def`
    for n, tok in enumerate(tokens):
        (row, col), (end_row, end_col) = tok.start, tok.end
        nxt = tokens[n + 1] if n + 1 < len(tokens) else None
        if tok.type == tokenize.NAME and tok.string in ("async", "await"):
            # drop the keyword and the space after it
            stop = nxt.start[1] if nxt is not None and nxt.start[0] == row else end_col
            edits.append((row, col, stop, ""))
            if tok.string == "async" and nxt is not None and nxt.string == "def":
                signatures.append(n)
        elif tok.type == tokenize.NAME and tok.string == "Awaitable" and nxt is not None and nxt.string == "[":
            edits.append((row, col, nxt.end[1], ""))
            depth_to_drop.append(depth)
        elif tok.type == tokenize.NAME and tok.string == "Awaitable":  # in an import list: drop the name
            if nxt is not None and nxt.string == ",":
                edits.append((row, col, tokens[n + 2].start[1] if tokens[n + 2].start[0] == row else nxt.end[1], ""))
            else:
                edits.append((row, tokens[n - 1].start[1], end_col, ""))
        elif tok.type == tokenize.NAME and tok.string in RENAMES:
            edits.append((row, col, end_col, RENAMES[tok.string]))
        elif tok.type == tokenize.NAME and tok.string.endswith("_async"):  # x_async -> x (modules too)
            edits.append((row, col, end_col, tok.string.removesuffix("_async")))
        elif tok.type == tokenize.STRING and _is_docstring(tokens, n):
            renamed = _rename_words(tok.string)
            if renamed != tok.string:
                if row != end_row:  # a multi-line string: rename its lines in place
                    for r in range(row, end_row + 1):
                        lines[r - 1] = _rename_words(lines[r - 1])
                else:
                    edits.append((row, col, end_col, renamed))
        elif tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
            if tok.string == "]" and depth_to_drop and depth_to_drop[-1] == depth:
                depth_to_drop.pop()
                edits.append((row, col, end_col, ""))
    for n in signatures:
        edits.extend(_realign(tokens, n, edits))
    for row, start, end, new in sorted(edits, reverse=True):
        line = lines[row - 1]
        lines[row - 1] = line[:start] + new + line[end:]
    result = "".join(lines)
    _check(result)
    return result


def _is_docstring(tokens: list[tokenize.TokenInfo], n: int) -> bool:
    """A string that is a statement of its own (a docstring): messages in code are left as they are."""
    before = tokens[n - 1].type if n else tokenize.NEWLINE
    after = tokens[n + 1].type if n + 1 < len(tokens) else tokenize.NEWLINE
    return before in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING) \
        and after in (tokenize.NEWLINE, tokenize.ENDMARKER)


def _realign(tokens: list[tokenize.TokenInfo], n: int,
             edits: list[tuple[int, int, int, str]]) -> list[tuple[int, int, int, str]]:
    """Keep a signature's continuation lines aligned under its opening bracket once ``async `` and the
    name's prefix or suffix went: shift them left by what the edits before the bracket removed."""
    row = tokens[n].start[0]
    bracket = next(t for t in tokens[n:] if t.string == "(")
    shift = sum(end - start - len(new) for r, start, end, new in edits if r == row and start < bracket.start[1])
    dedents = []
    for tok in tokens[n:]:
        if tok.type == tokenize.NEWLINE:
            break
        if tok.start[0] > row and tok.type not in (tokenize.NL, tokenize.COMMENT) and tok.start[1] > shift:
            dedents.append((tok.start[0], 0, shift, ""))
            row = tok.start[0]
    return dedents if shift > 0 else []


def _check(text: str) -> None:
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Await | ast.AsyncFunctionDef | ast.AsyncWith | ast.AsyncFor):
            raise SyntaxError(f"line {node.lineno}: an async construct is left in the sync module")
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        if name.startswith("Async") or name.endswith("_async"):
            raise SyntaxError(f"line {getattr(node, 'lineno', '?')}: async name {name!r} left (add it to RENAMES)")


def sources(root: Path = ROOT) -> list[Path]:
    return sorted(p for package in PACKAGES for p in (root / package).rglob("*_async.py"))


def target(source: Path) -> Path:
    return source.with_name(source.name.removesuffix("_async.py") + ".py")


def generate(source: Path, root: Path = ROOT) -> str:
    """The text ``target(source)`` must hold."""
    name = source.relative_to(root).as_posix()
    return HEADER.format(source=name) + transform(source.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="fail when a generated module differs from its source")
    mode.add_argument("--write", action="store_true", help="rewrite the generated modules")
    args = parser.parse_args(argv)
    stale = []
    for source in sources():
        out, want = target(source), generate(source)
        if out.exists() and out.read_text() == want:
            continue
        stale.append(out)
        if args.write:
            out.write_text(want)
            print(f"wrote {out.relative_to(ROOT)}")
    if args.check and stale:
        for out in stale:
            print(f"{out.relative_to(ROOT)} differs from its async source: run scripts/async_to_sync.py --write",
                  file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
