"""The relay runner: one sink's delivery loop, as parts that each own their state.

``loop.SinkRunner`` composes them; what each owns:

- ``cursors.CursorBook``: where each held bucket's reading stands, which cursor writes are due (pure);
- ``checkpoints.CheckpointWriter``: every fenced write, the server-restart checks, the waiting fence check;
- ``keeper.LeaseKeeper``: buckets taken, renewed and handed back; ``leases``: what is held, what was lost;
- ``delivery.Delivery``: new events and due parked keys; ``batch``: one batch and its ``sink.Commit``;
- ``prober.CrashLoopProber`` over ``ramp.Ramp``: crash-loop isolation;
- ``reads``, ``parked``, ``health``, ``tally``, ``hints``, ``gate``, ``hooks``: the small rest.

Every part logs as ``outbox_relay.relay``, the runner's logger before it was a package.
"""

from .batch import BatchCommit, Batches
from .checkpoints import CHECKPOINT_RETRY, CheckpointWriter
from .cursors import AHEAD_FLUSH_UNFILTERED_SECONDS, OWED_BUSY_SLACK_SECONDS, CursorBook
from .delivery import PARKED_KEYS_PER_PASS, PARKED_PER_KEY, Delivery
from .gate import DeliveryGate, Pulse
from .hints import Hints
from .keeper import LeaseKeeper
from .leases import Leases, Losses
from .loop import CYCLE_BACKOFF, SinkRunner
from .outcomes import CRASH_ERROR, classify, points_at_events
from .parked import PARK_CHECK_IDLE_SECONDS, PARKED_NOTICE, ParkSchedule
from .prober import PROBE_QUIET_STEPS, CrashLoopProber
from .ramp import Ramp
from .reads import MIN_BUCKET_LIMIT, ReadPlan, SnapshotTimes, read_limits

__all__ = [
    "AHEAD_FLUSH_UNFILTERED_SECONDS", "CHECKPOINT_RETRY", "CRASH_ERROR", "CYCLE_BACKOFF", "MIN_BUCKET_LIMIT",
    "OWED_BUSY_SLACK_SECONDS", "PARKED_KEYS_PER_PASS", "PARKED_NOTICE", "PARKED_PER_KEY", "PARK_CHECK_IDLE_SECONDS",
    "PROBE_QUIET_STEPS", "BatchCommit", "Batches", "CheckpointWriter", "CrashLoopProber", "CursorBook", "Delivery",
    "DeliveryGate", "Hints", "LeaseKeeper", "Leases", "Losses", "ParkSchedule", "Pulse", "Ramp", "ReadPlan",
    "SinkRunner", "SnapshotTimes", "classify", "points_at_events", "read_limits",
]
