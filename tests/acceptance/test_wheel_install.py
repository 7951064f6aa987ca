"""The install story of the README, as a new user meets it: the wheel built from this tree, installed
into a clean virtualenv with its dependencies from the package index (not from the test environment),
then `outbox-relay --version` and `outbox-relay migrate` against a new, empty test database.

Skipped, saying why, when the package index can not be reached.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

pytestmark = pytest.mark.slow  # the install downloads the dependencies: about a minute

ROOT = Path(__file__).resolve().parents[2]
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/") + "/"


def _index_unreachable() -> str | None:
    """Why the package index can not be used, or None when it answers."""
    try:
        with urllib.request.urlopen(INDEX + "psycopg/", timeout=15) as response:
            response.read(1)
    except (urllib.error.URLError, OSError) as exc:
        return f"the package index {INDEX} is unreachable ({exc}): the wheel's dependencies can not be installed"
    return None


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_the_wheel_installs_into_a_clean_venv_and_migrates(
        tmp_path: Path, database_factory: Callable[..., str]) -> None:
    reason = _index_unreachable()
    if reason:
        pytest.skip(reason)

    # --no-build-isolation: hatchling is a test dependency, so the build itself needs no network.
    dist = tmp_path / "dist"
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "--disable-pip-version-check", "-q", "--wheel-dir", str(dist), str(ROOT)], cwd=tmp_path, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("outbox_relay-*.whl")

    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    # Nothing of the test environment leaks in: no PYTHONPATH, no OUTBOX_* settings, and the
    # working directory is not the source tree (whose packages would shadow the installed ones).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PYTHON", "VIRTUAL_ENV"))}
    installed = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                      str(wheel)], cwd=tmp_path, env=env, timeout=600)
    assert installed.returncode == 0, installed.stderr

    version = _run([str(venv / "bin" / "outbox-relay"), "--version"], cwd=tmp_path, env=env)
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"outbox-relay {expected}"

    where = _run([str(venv / "bin" / "python"), "-c", "import outbox_relay; print(outbox_relay.__file__)"],
                 cwd=tmp_path, env=env)
    assert Path(where.stdout.strip()).is_relative_to(venv), where  # the installed copy, not the source tree

    dsn = database_factory(migrated=False)
    migrated = _run([str(venv / "bin" / "outbox-relay"), "migrate"], cwd=tmp_path, env={**env, "OUTBOX_DSN": dsn})
    assert migrated.returncode == 0, migrated.stderr
    with psycopg.connect(dsn) as conn:
        (tables,) = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'outbox'").fetchone() or (0,)
    assert tables > 0, "migrate exited 0 but created no outbox tables"
