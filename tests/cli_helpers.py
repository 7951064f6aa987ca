"""Running the ``outbox-relay`` command in-process, as the CLI tests do."""

from __future__ import annotations

import pytest

from outbox_relay import cli


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``cli.main(argv)``: its exit code, and what it printed to stdout and stderr."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
