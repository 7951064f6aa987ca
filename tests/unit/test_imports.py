"""A producer's ``import outbox_relay`` stays light: no relay engine, no confluent-kafka, no pool."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_package_loads_neither_the_engine_nor_kafka() -> None:
    code = ("import sys, outbox_relay; from outbox_relay import Outbox, wait_for; "
            "print(sorted(m for m in ('confluent_kafka', 'psycopg_pool', 'outbox_relay.worker', "
            "'outbox_relay.sinks.kafka', 'projections') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_engine_is_there_when_asked_for() -> None:
    import outbox_relay
    from outbox_relay.worker import Worker

    assert outbox_relay.Worker is Worker


def test_errors_import_nothing_of_the_package() -> None:
    """errors.py is the bottom layer: every module may raise its errors, so it imports none of them (it
    and dsn.py once imported each other)."""
    import ast
    from pathlib import Path

    import outbox_relay.errors

    tree = ast.parse(Path(outbox_relay.errors.__file__).read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    ours = [ast.unparse(n) for n in imports
            if (isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("outbox_relay")))
            or (isinstance(n, ast.Import) and any(a.name.startswith("outbox_relay") for a in n.names))]
    assert ours == []


def test_one_version_string() -> None:
    """The installed distribution's version (pyproject.toml) is what --version prints and what a relay's
    heartbeat records."""
    from importlib.metadata import version

    import outbox_relay
    from outbox_relay import cli
    from outbox_relay.services import registration

    assert outbox_relay.__version__ == version("outbox-relay") == cli.version()
    assert registration.__version__ == outbox_relay.__version__  # the name the heartbeat metadata uses
    assert not hasattr(registration, "VERSION")


def test_the_cli_runs_no_sql_of_its_own() -> None:
    """Operator actions live in outbox_relay.admin (a library that tests and services call); the command
    only parses and prints, so it must not grow queries of its own again."""
    from pathlib import Path

    import outbox_relay.cli

    found = [f"{path.name}: {needle}" for path in sorted(Path(outbox_relay.cli.__file__).parent.glob("*.py"))
             for needle in ("sqlfiles", "query(", ".execute(", "cursor(") if needle in path.read_text()]
    assert found == []
