"""Waking sink runners: all of them, all with every bucket to read, or those a notification concerns."""

from __future__ import annotations

from collections.abc import Sequence

from ..relay import PARKED_NOTICE, SinkRunner


def wake_all(runners: Sequence[SinkRunner]) -> None:
    for r in runners:
        r.park_changed.set()  # a missed notification may have been an operator's (PARKED_NOTICE)
        r.wake.set()


def read_everything(runners: Sequence[SinkRunner]) -> None:
    """Notifications may have been missed (LISTEN connection lost): every runner reads all its buckets."""
    for r in runners:
        r.hints.everything()
        r.park_changed.set()  # a missed notification may have been an operator's (PARKED_NOTICE)
        r.wake.set()


def wake_owners(runners: Sequence[SinkRunner], payload: str) -> None:
    """Wake the runners that hold or want one of the buckets a commit wrote or a relay freed (all,
    if the payload is not a list of buckets). An operator's PARKED_NOTICE also has them look at their park."""
    parked = payload.startswith(PARKED_NOTICE)
    try:
        buckets = [int(b) for b in payload.removeprefix(PARKED_NOTICE).split(",")]
    except ValueError:
        read_everything(runners)
        return
    for r in runners:
        desired = r.desired  # replaced whole by the membership thread, never mutated
        if r.leases.holds_any(buckets) or (desired is not None and not desired.isdisjoint(buckets)):
            r.hints.add(buckets)
            if parked:
                r.park_changed.set()
            r.wake.set()
