"""The runner package as its users see it: ``outbox_relay.relay`` keeps its names, and a runner is freed
as soon as it is dropped (no part refers back to it)."""

from __future__ import annotations

import gc
import weakref

from outbox_relay import relay, runner
from outbox_relay.settings import RelaySettings


class Quiet:
    name, kind, event_filter = "quiet", "test", None

    def deliver(self, *args: object) -> set[int]:
        return set()

    def close(self) -> None:
        pass


def test_the_relay_module_offers_the_runner_packages_objects() -> None:
    for name in relay.__all__:
        assert getattr(relay, name) is getattr(runner, name)


def test_a_dropped_runner_is_freed_without_a_garbage_collection() -> None:
    settings = RelaySettings(dsn="postgresql://localhost/none", worker_id="w")  # type: ignore[arg-type]
    gc.disable()
    try:
        made = runner.SinkRunner(Quiet(), None, settings)  # type: ignore[arg-type]
        freed = weakref.ref(made)
        del made
        assert freed() is None, "a reference cycle keeps it until a collection"
    finally:
        gc.enable()
