"""Upcasting: payloads published in an older shape, turned into the current one per event type.

Events carry the version of their payload's schema (``publish(..., version=2)``, stored as
``outbox.events.schema_version``, 1 by default). A read model declared today expects today's shape,
but a rebuild replays history written in every shape the type ever had. An ``Upcasters`` holds one
step per (type, version): a function from a payload of that version to the same event's payload at
the next version. A projection given ``upcasters=`` sees every event at its type's current version,
the highest registered step's version + 1::

    upcasters = Upcasters()

    @upcasters.register("OrderPlaced", version=1)
    def cents(payload):  # version 1 had "amount" in euros; version 2 has "cents"
        return {"customer": payload["customer"], "cents": round(payload["amount"] * 100)}

Steps run in order (1 -> 2 -> 3 ...) on the decoded JSON, before a declared pydantic model
validates the result. Why events fail instead of going through unchanged (Projection.prepare):
a version newer than the code knows, or a missing step, is a deploy ordering problem that new code
fixes, so the event waits and is retried; a step that raises is a bug in the step or an event it
can not handle, so that event goes to dead letters with the error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import ConfigurationError, OutboxError

Step = Callable[[Any], Any]


class UpcastError(OutboxError):
    """An event can not be brought to its type's current version; ``retriable``: new code can."""

    def __init__(self, message: str, retriable: bool) -> None:
        super().__init__(message)
        self.retriable = retriable


class Upcasters:
    """Upcasting steps per (event type, version); see the module docstring."""

    def __init__(self) -> None:
        self._steps: dict[tuple[str, int], Step] = {}
        self._current: dict[str, int] = {}

    def register(self, type: str, version: int) -> Callable[[Step], Step]:
        """Decorator: ``fn(payload)`` turns a payload of ``version`` of ``type`` into ``version + 1``."""
        if not isinstance(type, str) or not type:
            raise ConfigurationError(f"upcaster: the event type must be a non-empty string, not {type!r}")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ConfigurationError(f"upcaster for {type!r}: version must be an integer >= 1, not {version!r}")
        if (type, version) in self._steps:
            raise ConfigurationError(f"upcaster for {type!r} version {version} is registered twice")

        def add(fn: Step) -> Step:
            self._steps[(type, version)] = fn
            self._current[type] = max(self._current.get(type, 1), version + 1)
            return fn

        return add

    def current(self, type: str) -> int:
        """The version every event of ``type`` is brought to (1 if no step is registered for it)."""
        return self._current.get(type, 1)

    def upcast(self, type: str, version: int, payload: Any) -> tuple[Any, int]:
        """``payload`` at the current version of ``type``, and that version."""
        current = self.current(type)
        if version > current:
            raise UpcastError(f"{type!r} event has schema version {version}, newer than this code knows (its upcasters "
                              f"end at version {current}): deploy the code that knows it; the event waits", True)
        while version < current:
            step = self._steps.get((type, version))
            if step is None:
                raise UpcastError(f"no upcaster turns {type!r} version {version} into {version + 1} (the current "
                                  f"version is {current}): register one; the event waits", True)
            try:
                payload = step(payload)
            except Exception as exc:
                name = getattr(step, "__qualname__", repr(step))
                raise UpcastError(f"upcaster {name} ({type!r} version {version} -> {version + 1}) failed: "
                                  f"{exc.__class__.__name__}: {exc}", False) from exc
            version += 1
        return payload, version
