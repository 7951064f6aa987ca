"""The README's first command runs examples/demo.py: it must pass, and print what it promises (issue 9:
the demo prints a metrics scrape; issue 18: a poison event dead-lettered and retried after the fix, and a
killed relay's buckets taken over)."""

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
    assert "relay-a was killed (SIGKILL) earlier" in out and "relay-b exited with 0" in out, out[-3000:]
    assert "Traceback" not in out
    # The poison event: rejected by the projection's handler, dead-lettered with its error, listed, then
    # applied by `dead-letters retry` once the customer exists.
    assert re.search(r"dead-lettered after 3 attempts: UnknownCustomer: unknown customer 'customer-new'", out), out
    assert re.search(r"customer_orders +\S+ +order:99 +OrderPlaced", out), "dead-letters list shows it"
    assert "1 dead letters queued for retry" in out
    assert "order 99 applied after the retry; 21 orders in the read model (of 21 placed), 0 dead letters left" in out
    # The takeover: the moment and the bound are printed; relay-b then delivers the later orders alone.
    assert re.search(r"relay-b holds all 512 buckets \d+\.\d s after the kill \(bound: .*about 2\.5 s", out), out
    assert re.search(r"per-key order ok for all 21 keys", out), out[-3000:]
