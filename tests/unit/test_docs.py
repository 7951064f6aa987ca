"""The docs a reader reaches: the configuration reference is current, the README short, every link resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_settings_table_in_the_configuration_reference_is_current() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "settings_table.py"), "--check"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr or result.stdout


DOCS_MAX_BYTES = 160 * 1024  # the user book (issue 26): run diaries and fault reports live in bench/results/


def test_the_user_book_stays_short() -> None:
    """Counted as `du -sb docs` counts: every file and directory entry (a subdirectory costs 4 KiB)."""
    docs = ROOT / "docs"
    sizes = {p: p.stat().st_size for p in (docs, *docs.rglob("*"))}
    total = sum(sizes.values())
    largest = sorted(sizes, key=sizes.__getitem__, reverse=True)[:3]
    assert total <= DOCS_MAX_BYTES, (f"docs/ is {total:,} bytes, more than {DOCS_MAX_BYTES:,}; the largest: "
                                     + ", ".join(f"{p.relative_to(ROOT)} ({sizes[p]:,})" for p in largest))


# -- the README and docs a newcomer reads (issue 18 item 2) ------------------------------------------

README_MAX_BYTES = 12 * 1024  # a README that gets a user to a running relay; internals live in docs/
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images are not links to follow
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _docs() -> list[Path]:
    """Every page a reader reaches: the README, CONTRIBUTING and the markdown under docs/."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_readme_is_at_most_12_kb() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}: move detail into docs/"


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    broken = []
    for page in _docs():
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not resolved.exists():
                broken.append(f"{where}: {path} does not exist")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{where}: {resolved.relative_to(ROOT)} has no heading #{anchor}")
    assert not broken, "\n".join(broken)


def test_the_docs_index_lists_every_doc() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    linked = {(ROOT / "docs" / t.partition("#")[0]).resolve() for t in LINK.findall(index)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "README.md" and p not in linked]
    assert not missing, f"docs/README.md (the index) does not list: {', '.join(missing)}"


def test_the_contributor_brief_is_not_among_the_user_docs() -> None:
    assert not (ROOT / "docs" / "design-brief.md").exists()
    assert "## Design brief" in (ROOT / "CONTRIBUTING.md").read_text()


def test_readme_keeps_the_two_commands_of_a_fresh_machine() -> None:
    readme = (ROOT / "README.md").read_text()
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh", "pip install outbox-relay"):
        assert command in readme, f"README.md lost {command!r}"
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
