"""Each generated sync module is what scripts/async_to_sync.py makes of its async source (CI fails
otherwise), and the transformer does what it says."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("async_to_sync", ROOT / "scripts" / "async_to_sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["async_to_sync"] = module
    spec.loader.exec_module(module)
    return module


tool = _tool()


@pytest.mark.parametrize("source", tool.sources(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_generated_module_matches_its_async_source(source: Path) -> None:
    generated = tool.target(source)
    assert generated.exists(), f"{generated} is missing: run scripts/async_to_sync.py --write"
    assert generated.read_text() == tool.generate(source), \
        f"{generated.name} differs from {source.name}: edit the async source, then scripts/async_to_sync.py --write"


def test_there_are_sources() -> None:
    assert len(tool.sources()) >= 1


def test_transform_keeps_comments_and_drops_async() -> None:
    source = (
        "import asyncio\n"
        "from collections.abc import Awaitable, Callable\n\n\n"
        "async def wait_for_async(aconn: AsyncConnection, f: Callable[[], Awaitable[int]],\n"
        "                         x: int) -> int:\n"
        '    """``wait_for_async`` on an AsyncConnection."""\n'
        "    async with aconn.cursor() as cur:  # one cursor\n"
        "        await asyncio.sleep(0)\n"
        "    if True:  # ASYNC\n"
        "        n = (await f())\n"
        "    else:\n"
        "        n = f() + 0\n"
        "    return n\n"
    )
    assert tool.transform(source) == (
        "import time\n"
        "from collections.abc import Callable\n\n\n"
        "def wait_for(conn: Connection, f: Callable[[], int],\n"
        "             x: int) -> int:\n"
        '    """``wait_for`` on an Connection."""\n'
        "    with conn.cursor() as cur:  # one cursor\n"
        "        time.sleep(0)\n"
        "    n = f() + 0\n"
        "    return n\n"
    )


def test_transform_refuses_what_it_cannot_make_sync() -> None:
    with pytest.raises(SyntaxError, match="AsyncThing"):
        tool.transform("async def f(x: AsyncThing) -> None:\n    await x\n")


def test_check_mode_passes_on_the_tree() -> None:
    assert tool.main(["--check"]) == 0
