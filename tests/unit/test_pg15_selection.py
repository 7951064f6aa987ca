"""The PostgreSQL 15 step of scripts/test.sh runs the tests marked ``pg15`` in the files it lists: a file
listed without marks would run nothing there, and marks in a file it does not list would run nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "test.sh"
MARK = re.compile(r"\bpytest\.mark\.pg15\b")


def listed() -> list[str]:
    text = SCRIPT.read_text()
    block = re.search(r"^PG15_TESTS=\((.*?)^\)", text, re.S | re.M)
    assert block, "no PG15_TESTS=( ... ) in scripts/test.sh"
    return [name for line in block.group(1).splitlines() for name in line.split("#")[0].split()]


def test_every_listed_file_has_pg15_tests_and_every_marked_file_is_listed() -> None:
    names = listed()
    assert len(names) == len(set(names)) and len(names) >= 30, names
    unmarked = [n for n in names if not MARK.search((ROOT / "tests" / "integration" / n).read_text())]
    assert not unmarked, f"listed for PostgreSQL 15 with no test marked pg15: {unmarked}"
    marked = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
              if p.name != Path(__file__).name and MARK.search(p.read_text())}
    expected = {f"tests/integration/{n}" for n in names}
    assert marked == expected, sorted(marked ^ expected)


def test_the_step_selects_the_marked_tests() -> None:
    text = SCRIPT.read_text()
    assert '-m "pg15 and not slow"' in text and '"${PG15_TESTS[@]/#/tests/integration/}"' in text
