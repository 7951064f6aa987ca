"""One sink's delivery loop: lease buckets, read past their cursors, deliver, checkpoint.

The code is in the ``runner`` package (one part per piece of state, ``runner/__init__.py`` says which);
this module keeps the names ``outbox_relay.relay`` has always offered, and the logger every part of the
runner logs on (``outbox_relay.relay``).

No SQL here (store.py has it). Per key, events go out in position order; a failing head
parks its key (only that key waits), retries with backoff and ends in dead letters after
``max_attempts``. Every checkpoint is fenced: a worker that lost a bucket writes nothing
there.

Crash-loop isolation: an event that kills the process (or stalls it past its lease) never
reports a failure, so it is found another way. A bucket whose lease lapsed ``max_lapses``
times with work pending is a suspect. Its next owner delivers it one event at a time, each
attempt counted in ``outbox.parked`` *before* it is made and made alone in the process (the
``DeliveryGate``), so a crash during it can only be that event's doing and counts as a
failed attempt; past ``max_attempts`` the event is dead-lettered like any other. After
each survived probe the bucket's batch size doubles until it is back to normal.

A batch that fails as a whole with an exception (a sink bug, an event the sink can not even
start on, a handler cut off by a timeout) is treated the same way, without waiting for lapses:
its buckets become suspects at once, the probe finds the event that causes it and records the
exception as that event's error. A failing cycle backs off; notifications do not cut it short.

A runner that makes no progress (its sink has not checked the stop flag for
``handler_timeout_seconds``, or its cycles keep failing for that long) is *stuck*: the membership
thread stops renewing its leases and releases them, its heartbeats leave it out of the sink's live
members (so the assignment moves its buckets to other relays), and /readyz says so. It rejoins by
itself once it makes progress again; the fences keep whatever it still does from landing.
"""

from __future__ import annotations

from .runner import (
    AHEAD_FLUSH_UNFILTERED_SECONDS,
    CHECKPOINT_RETRY,
    CRASH_ERROR,
    CYCLE_BACKOFF,
    MIN_BUCKET_LIMIT,
    OWED_BUSY_SLACK_SECONDS,
    PARK_CHECK_IDLE_SECONDS,
    PARKED_KEYS_PER_PASS,
    PARKED_NOTICE,
    PARKED_PER_KEY,
    PROBE_QUIET_STEPS,
    DeliveryGate,
    Hints,
    Leases,
    Pulse,
    SinkRunner,
    classify,
    points_at_events,
    read_limits,
)

__all__ = [
    "AHEAD_FLUSH_UNFILTERED_SECONDS", "CHECKPOINT_RETRY", "CRASH_ERROR", "CYCLE_BACKOFF", "MIN_BUCKET_LIMIT",
    "OWED_BUSY_SLACK_SECONDS", "PARKED_KEYS_PER_PASS", "PARKED_NOTICE", "PARKED_PER_KEY", "PARK_CHECK_IDLE_SECONDS",
    "PROBE_QUIET_STEPS", "DeliveryGate", "Hints", "Leases", "Pulse", "SinkRunner", "classify", "points_at_events",
    "read_limits",
]
