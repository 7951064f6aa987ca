"""Logging of the ``outbox-relay`` command: plain or JSON lines on stderr, secrets redacted, the worker id on each."""

from __future__ import annotations

import json
import logging
import sys
import time

from ..dsn import redact
from .output import printable


class _WorkerIdFilter(logging.Filter):
    def __init__(self, worker_id: str) -> None:
        super().__init__()
        self.worker_id = worker_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker_id = self.worker_id
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "worker": getattr(record, "worker_id", None),
            "thread": record.threadName,
            "message": redact(record.getMessage()),
        }
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry)


class _RedactingFormatter(logging.Formatter):
    """Plain lines for a terminal: secrets masked, and what producers and remote servers wrote (keys, types,
    errors, response excerpts) escaped, so that no escape sequence in them reaches the terminal."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(redact(super().format(record)))


_json_logs = False  # set by setup_logging: stderr carries JSON log records only (--log-json)


def logs_as_json() -> bool:
    """Whether stderr carries JSON log records only (--log-json): then a command says things by logging them."""
    return _json_logs


def setup_logging(level: str, as_json: bool, worker_id: str) -> None:
    global _json_logs
    _json_logs = as_json
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_WorkerIdFilter(worker_id))
    handler.setFormatter(_JsonFormatter() if as_json else _RedactingFormatter(
        "%(asctime)s %(levelname)s %(name)s [worker=%(worker_id)s %(threadName)s] %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
