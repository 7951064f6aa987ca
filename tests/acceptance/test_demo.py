"""The README's first command runs examples/demo.py: it must pass, and print what it promises (issue 9:
the demo prints a metrics scrape)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.py"


def test_the_demo_delivers_in_order_prints_a_scrape_and_drains() -> None:
    result = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=240,
                            stdin=subprocess.DEVNULL)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    delivered = re.search(r'outbox_relay_events_delivered_total\{sink="kafka"\} (\d+)\.0', out)
    assert delivered is not None and int(delivered.group(1)) > 0, out[-3000:]
    assert '200 {"ok": true, "problems": []}' in out, "the demo shows a ready relay"
    assert "relay-a exited with 0" in out and "relay-b exited with 0" in out, out[-3000:]
    assert "Traceback" not in out
