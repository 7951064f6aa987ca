"""The code base keeps the shape issue 26 gave it, read from the source with ``ast`` (nothing is imported):
modules and classes small enough to live in, no private name crossing a module boundary (what is shared is
public in its own module), and in ``outbox_relay/`` only the composition root knows ``projections``.

Each test lists every offender, so a failure says what is left to fix. Generated sync modules
(scripts/async_to_sync.py) are modules like any other: their async source has the same size.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("outbox_relay", "projections")
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
# The only modules of outbox_relay/ that may import projections: the composition root.
COMPOSITION_ROOT = ("outbox_relay/compose.py", "outbox_relay/cli/")
# Underscore names that their library documents as public.
DOCUMENTED_UNDERSCORE = {"os._exit"}


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _dotted(path: Path) -> str:
    """``outbox_relay/cli/common.py`` -> ``outbox_relay.cli.common``; a package is its ``__init__``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_our_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module (not a name inside one) of our packages."""
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _source_module(path: Path, node: ast.ImportFrom) -> str:
    """The absolute name of the module a ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    package = _dotted(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]  # a module's package; a package's __init__ is its own package
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import, at the top, in a function (lazy) or under ``if TYPE_CHECKING``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _module_aliases(path: Path, tree: ast.AST) -> dict[str, str]:
    """The local names (or dotted chains, for ``import a.b``) bound to a module: ``import a.b as m``,
    ``import a.b`` (``a.b`` is used as written), ``from a import b`` where ``a.b`` is one of our modules."""
    aliases: dict[str, str] = {}
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name] = alias.name
        else:
            source = _source_module(path, node)
            for alias in node.names:
                if _is_our_module(f"{source}.{alias.name}"):
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
    return aliases


def _listed(problem: str, found: list[str]) -> str:
    return "\n  ".join([f"{problem}:", *found])


def test_no_module_over_the_line_limit() -> None:
    over = [f"{_rel(p)}: {n} lines" for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not over, _listed(f"modules over {MAX_MODULE_LINES} lines (split them by the state they hold)", over)


def test_no_class_over_the_line_limit() -> None:
    over = [f"{_rel(p)}:{node.lineno} class {node.name}: {size} lines"
            for p in _modules() for node in ast.walk(_tree(p))
            if isinstance(node, ast.ClassDef)
            and (size := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_CLASS_LINES]
    assert not over, _listed(f"classes over {MAX_CLASS_LINES} lines (a class this size holds several objects' state)",
                             over)


def _private_uses(path: Path, tree: ast.Module) -> Iterator[str]:
    """Private names ``tree`` (the module at ``path``) takes from other modules."""
    for node in _imports(tree):
        if isinstance(node, ast.ImportFrom):
            source = _source_module(path, node)
            for alias in node.names:
                if _is_private(alias.name):
                    yield f"{_rel(path)}:{node.lineno} imports {alias.name} from {source}"
        else:
            for alias in node.names:
                if any(_is_private(part) for part in alias.name.split(".")):
                    yield f"{_rel(path)}:{node.lineno} imports the private module {alias.name}"
    # `m._y` where m is a module bound by an import: the same reach across a boundary, spelled differently.
    aliases = _module_aliases(path, tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain = ast.unparse(node.value)
            if chain in aliases and f"{aliases[chain]}.{node.attr}" not in DOCUMENTED_UNDERSCORE:
                yield f"{_rel(path)}:{node.lineno} reads {chain}.{node.attr} of module {aliases[chain]}"


def test_no_private_name_crosses_a_module() -> None:
    found = [line for p in _modules() for line in _private_uses(p, _tree(p))]
    assert not found, _listed("private names used across modules (make what is shared public in its own module)", found)


def _imported_projections(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The projections modules an import names (none for an import of anything else)."""
    if isinstance(node, ast.ImportFrom):
        return [node.module] if not node.level and (node.module or "").split(".")[0] == "projections" else []
    return [alias.name for alias in node.names if alias.name.split(".")[0] == "projections"]


def test_only_the_composition_root_imports_projections() -> None:
    found = [f"{_rel(p)}:{node.lineno} {ast.unparse(node)}"
             for p in _modules() if _rel(p).startswith("outbox_relay/") and not _rel(p).startswith(COMPOSITION_ROOT)
             for node in _imports(_tree(p))
             if _imported_projections(node)]
    assert not found, _listed("outbox_relay/ imports projections outside compose.py and cli/", found)


# -- the checks check: each rule catches what it names -------------------------------------------------


def test_the_private_name_rule_resolves_relative_imports() -> None:
    path = ROOT / "outbox_relay" / "cli" / "relays.py"
    node = ast.parse("from ..sinks.engine import _x").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _source_module(path, node) == "outbox_relay.sinks.engine"
    init = ROOT / "outbox_relay" / "cli" / "__init__.py"
    node = ast.parse("from .common import _x").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _source_module(init, node) == "outbox_relay.cli.common"
    assert _is_private("_x") and not _is_private("__version__") and not _is_private("x")


def test_the_private_name_rule_sees_every_form() -> None:
    source = ("from .common import _one, two\n"
              "from outbox_relay import store\n"
              "import outbox_relay.store as s\n"
              "import outbox_relay.store\n"
              "def f():\n"
              "    from x import _lazy\n"
              "    return store._a, s._b, outbox_relay.store._c, store.public, store.__name__\n")
    found = _private_uses(ROOT / "outbox_relay" / "cli" / "relays.py", ast.parse(source))
    assert [line.split(" ", 1)[1] for line in found] == [
        "imports _one from outbox_relay.cli.common",
        "imports _lazy from x",
        "reads store._a of module outbox_relay.store",
        "reads s._b of module outbox_relay.store",
        "reads outbox_relay.store._c of module outbox_relay.store",
    ]


def test_the_projections_rule_sees_both_forms() -> None:
    forms = ["import projections", "import projections.walk as w", "from projections.testing import x",
             "from projections import walk", "import outbox_relay.projections_like", "from .projections import x"]
    assert [_imported_projections(node) for f in forms for node in _imports(ast.parse(f))] == [
        ["projections"], ["projections.walk"], ["projections.testing"], ["projections"], [], []]
