"""Which relay should hold which bucket of a sink: balanced, and moving as little as possible.

The assignment is stored per sink (``outbox.assignments``) and changed only when the sink's live
members change, by whichever relay notices first (a compare-and-set on its generation), so every
relay follows the same table. Storing it is what allows both goals at once: a function of the member
set alone (a hash ring, rendezvous hashing, Maglev) either balances loosely (a ring of 64 virtual
nodes: max/mean 2.3 with 64 relays, some owning nothing) or, balanced exactly, moves several times the
ideal share when a relay joins or leaves.

``rebalance`` keeps every bucket where it is unless its owner left or holds more than its share: with
N members each holds 256 // N buckets, and the 256 % N members that hold most now hold one more. So
a joining relay takes about 1/(N+1) of the buckets, all from relays above their new share, and a
leaving relay's buckets go to those below it; nothing else moves. Free buckets go, in a fixed order,
to the member with room that rendezvous hashing prefers, so an assignment built from nothing is
deterministic and spread.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence

BUCKETS = 256  # must match outbox.bucket_v1 and the cursors CHECK in sql/

Owners = list[str | None]  # index: bucket


def _score(label: str) -> int:
    return int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "big")


def rebalance(previous: Sequence[str | None], members: Iterable[str]) -> Owners:
    """The owner of each bucket once ``members`` (the live relays of a sink) take over from ``previous``
    (the stored assignment; an empty sequence when there is none)."""
    live = sorted(set(members))
    if not live:
        return [None] * BUCKETS
    owners: Owners = [o if o in live else None for o in (list(previous) + [None] * BUCKETS)[:BUCKETS]]
    held = Counter(o for o in owners if o is not None)
    base, extra = divmod(BUCKETS, len(live))
    # One more bucket for the members holding most already (ties: a fixed hash order), so that as few
    # as possible have to give one up.
    larger = set(sorted(live, key=lambda m: (-held[m], _score(f"share:{m}")))[:extra])
    share = {m: base + (m in larger) for m in live}
    for m in live:
        surplus = held[m] - share[m]
        if surplus > 0:  # give up the buckets this member is least attached to
            mine = sorted((b for b, o in enumerate(owners) if o == m), key=lambda b: _score(f"{m}#{b}"))
            for b in mine[:surplus]:
                owners[b] = None
            held[m] = share[m]
    room = {m: share[m] - held[m] for m in live}
    for b in sorted((b for b, o in enumerate(owners) if o is None), key=lambda b: _score(f"order:{b}")):
        m = max((m for m in live if room[m] > 0), key=lambda m: _score(f"{m}#{b}"))
        owners[b] = m
        room[m] -= 1
    return owners


def buckets_of(owners: Sequence[str | None], member: str) -> set[int]:
    return {b for b, o in enumerate(owners) if o == member}
