"""The installed ``outbox-relay`` command imports the user's modules from the working directory, as
uvicorn, gunicorn, celery and ``python -m`` do (a console script's sys.path starts at its bin/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

COMMAND = Path(sys.executable).parent / "outbox-relay"

MYAPP = '''
from projections import projection

@projection("totals", events=["OrderPlaced"], tables=["totals"])
def totals(event, tx):
    pass

NOT_A_SINK = 42
NOT_CALLABLE = 7
'''


def outbox_relay(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(COMMAND), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(name="project")
def project_fixture(tmp_path: Path) -> Path:
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "read_models.py").write_text(MYAPP)
    return tmp_path


def test_projections_sinks_and_handlers_are_found_in_the_working_directory(dsn: str, project: Path) -> None:
    assert COMMAND.exists(), COMMAND
    # Each command gets past the import and stops at what is wrong with the object it found: proof the
    # module was imported from the project's directory without PYTHONPATH.
    done = outbox_relay(project, "run", "--dsn", dsn, "--no-kafka", "--projections", "myapp.read_models",
                        "--projection", "nope")
    assert done.returncode == 2 and "unknown projection 'nope' (known: totals)" in done.stderr, done.stderr
    done = outbox_relay(project, "run", "--dsn", dsn, "--no-kafka", "--sink", "myapp.read_models:NOT_A_SINK")
    assert done.returncode == 2, done.stderr
    assert "No module named" not in done.stderr and "no module named" not in done.stderr, done.stderr
    assert "--sink myapp.read_models:NOT_A_SINK" in done.stderr, done.stderr
    done = outbox_relay(project, "inbox", "run", "--dsn", dsn, "--topic", "t", "--bootstrap-servers", "127.0.0.1:1",
                        "--handler", "myapp.read_models:NOT_CALLABLE")
    assert done.returncode == 2 and "is a int, not a callable" in done.stderr, done.stderr


def test_a_module_that_is_nowhere_names_the_directory_it_looked_in(dsn: str, project: Path) -> None:
    done = outbox_relay(project, "run", "--dsn", dsn, "--no-kafka", "--sink", "elsewhere:sink")
    assert done.returncode == 2, done.stderr
    assert f"--sink elsewhere:sink: no module named 'elsewhere' in {project}" in done.stderr, done.stderr
