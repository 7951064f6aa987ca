"""The console's browser test's sink (a user sink on the documented contract): it refuses the events of the
keys listed in the file $CONSOLE_SWITCH (one a line), so "fixing the cause" is rewriting that file, and
appends what it delivered to $CONSOLE_DELIVERED."""

from __future__ import annotations

import os
from pathlib import Path

from outbox_relay.sinks import Delivered, Retry, SinkEvent


class SwitchedSink:
    kind = "switched"
    name = "orders-sink"

    def __init__(self, switch: Path, delivered: Path) -> None:
        self.switch, self.delivered = switch, delivered

    def deliver(self, event: SinkEvent) -> Delivered | Retry:
        broken = set(self.switch.read_text().splitlines()) if self.switch.exists() else set()
        if event.key in broken:
            return Retry(f"downstream refused key {event.key}: {event.type} is not accepted yet")
        with self.delivered.open("a", encoding="utf-8") as out:
            out.write(f"{event.id}\n")
        return Delivered()


def make_sink() -> SwitchedSink:
    return SwitchedSink(Path(os.environ["CONSOLE_SWITCH"]), Path(os.environ["CONSOLE_DELIVERED"]))
