"""A sink of your own: every event appended to a JSON-lines file (an audit log), one line per event.

    outbox-relay migrate --dsn "$OUTBOX_DSN"
    AUDIT_LOG_PATH=/var/log/app/audit.jsonl PYTHONPATH=examples \
        outbox-relay run --dsn "$OUTBOX_DSN" --no-kafka --sink jsonl_sink:make_sink

The relay calls ``deliver`` once per event, in publish order per key, and takes care of everything
else: retries with backoff, dead letters, per-key order, fencing, metrics and the time limit. The sink
only says how each delivery went (docs/writing-a-sink.md):

- a line written and flushed to disk: ``Delivered()``;
- an event too large for the log: ``GiveUp`` (dead-lettered at once, the key goes on);
- the file can not be written at all (its directory is gone, the disk is full): ``SinkUnavailable``:
  not the event's fault, so the events wait without using up their attempts.

Delivery is at least once: after a crash the relay delivers again what it had not checkpointed, so a
reader of the log skips lines whose ``id`` it has seen. A crash in the middle of a write (SIGKILL, power)
can leave the last line torn; the sink ends such a line before it appends, so a reader skips the one line
that is not JSON and the events on it come again.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from outbox_relay.sinks import Delivered, GiveUp, SinkEvent, SinkUnavailable


class JsonLinesSink:
    kind = "jsonl"

    def __init__(self, path: str | os.PathLike[str], *, name: str = "audit-log", max_line_bytes: int = 1_000_000,
                 unavailable_seconds: float = 5.0) -> None:
        self.name = name  # its cursors, dead letters and metrics in the relay
        self.path = Path(path)
        self.max_line_bytes = max_line_bytes
        self.unavailable_seconds = unavailable_seconds
        self._lock = threading.Lock()  # with concurrency > 1, lines of several keys are written at once
        self._tail_checked = False  # whether a line torn by a crash before this process was ended

    def deliver(self, event: SinkEvent) -> Delivered | GiveUp:
        meta = json.dumps({"id": str(event.id), "key": event.key, "type": event.type, "topic": event.topic,
                           "time": event.time.isoformat(), "version": event.version})
        line = f'{meta[:-1]}, "payload": {event.payload_json}}}\n'  # the stored JSON as is, not re-encoded
        if len(line.encode()) > self.max_line_bytes:
            return GiveUp(f"the event is {len(line.encode())} bytes as a line, over the {self.max_line_bytes} byte "
                          "limit of the audit log")
        try:
            with self._lock, self.path.open("a", encoding="utf-8") as log:
                if not self._tail_checked:
                    line = self._after_torn_tail() + line
                    self._tail_checked = True
                log.write(line)
                log.flush()
                os.fsync(log.fileno())  # delivered means on disk: the relay checkpoints after this returns
        except OSError as exc:
            raise SinkUnavailable(f"cannot write to {self.path}: {exc.strerror or exc}",
                                  retry_after_seconds=self.unavailable_seconds) from exc
        return Delivered()


    def _after_torn_tail(self) -> str:
        """A newline if the log's last line was torn by a crash (it does not end with one), else nothing."""
        with self.path.open("rb") as log:
            if log.seek(0, os.SEEK_END) == 0:
                return ""
            log.seek(-1, os.SEEK_END)
            return "" if log.read(1) == b"\n" else "\n"


def make_sink() -> JsonLinesSink:
    """What ``--sink jsonl_sink:make_sink`` runs: the log at $AUDIT_LOG_PATH (default ./audit.jsonl)."""
    return JsonLinesSink(os.environ.get("AUDIT_LOG_PATH", "audit.jsonl"))
