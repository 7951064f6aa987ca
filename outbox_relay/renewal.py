"""How often a lease holder renews: the relay's buckets (services/membership.py) and the inbox's partitions share it."""

from __future__ import annotations

RENEWALS_PER_LEASE = 3  # a holder that misses two renewals in a row still holds its lease at the third


def renew_interval(lease_seconds: float) -> float:
    """Seconds between renewals of a lease of ``lease_seconds``."""
    return lease_seconds / RENEWALS_PER_LEASE
