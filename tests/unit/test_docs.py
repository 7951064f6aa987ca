"""The configuration reference in docs/operations.md is generated from RelaySettings: it must be current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_settings_table_in_the_operations_doc_is_current() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "settings_table.py"), "--check"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr or result.stdout
