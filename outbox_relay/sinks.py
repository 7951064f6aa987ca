"""STAND-IN for the public sink contract (the `sinks` helper's branch h-sinks replaces this file at merge).

Only the types of /tmp/briefs/contract.md, so that the webhook sink can be written and tested before
the real module lands.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol


@dataclass(frozen=True)
class SinkEvent:
    id: uuid.UUID
    topic: str | None
    key: str
    type: str
    payload_json: str
    headers: Mapping[str, str]
    time: datetime
    version: int
    attempt: int

    @property
    def payload(self) -> Any:
        return json.loads(self.payload_json)


@dataclass(frozen=True)
class Delivered:
    pass


@dataclass(frozen=True)
class Retry:
    reason: str
    after_seconds: float | None = None


@dataclass(frozen=True)
class GiveUp:
    reason: str


class SinkUnavailable(Exception):
    def __init__(self, reason: str, retry_after_seconds: float = 5.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_seconds = retry_after_seconds


class EventSink(Protocol):
    name: str
    kind: str

    def deliver(self, event: SinkEvent) -> Delivered | Retry | GiveUp | None: ...
