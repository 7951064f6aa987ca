"""The crash-loop ramp the relay's buckets and the inbox's partitions share: work suspected of killing its
process (a holder that stopped without releasing its lease) is probed one item alone first, then batches
of 2, 4, ... while each commits, until a batch of twice the size would pass the normal limit."""

from __future__ import annotations

FIRST_PROBE = 1  # a suspect's first probe: one item, alone
HEALTHY = 0  # not a suspect: normal batches


def next_probe_size(size: int, limit: int) -> int:
    """The probe after one of ``size`` items committed: twice as many, or HEALTHY once that passes ``limit``."""
    return HEALTHY if size * 2 > limit else size * 2
