"""Hot-key sharding: spread one busy partition key over several keys, ``key#0`` ... ``key#n-1``.

The relay keeps order per partition key, so one key's events go out one batch after another from
one bucket, on one relay. When a single key carries a large share of the traffic (one huge order, a
tenant, a singleton aggregate), publish its events under ``shard_key(key, shards, by)`` instead:
``by`` is a sub-key whose own events must stay in order (a line item, an account), and each value of
it always lands in the same shard. Shards are ordinary keys, so they fall into different buckets and
are delivered in parallel, by several relays and to several Kafka partitions.

What that gives up: order holds within a shard (so for each value of ``by``), not across the shards
of the key. docs/sharding.md says when that is acceptable and how consumers cope (``shards_of``
lists the keys to merge).

The shard of a value is part of the stored data (events, Kafka keys, consumers' state), so it must
never change: it is a fixed hash (BLAKE2b) of the value's canonical bytes, the same in every process,
on every platform and in every release (pinned by tests/unit/test_sharding.py). Python's ``hash()``
would not do: it is salted per process.
"""

from __future__ import annotations

import hashlib
import uuid

from .errors import InvalidEvent
from .event import MAX_KEY_BYTES

SEPARATOR = "#"
# A sink has 256 buckets: more shards than that can not be delivered more in parallel.
MAX_SHARDS = 256

SubKey = str | int | bytes | uuid.UUID


def shard_key(key: str, shards: int, by: SubKey) -> str:
    """The key to publish an event of ``key`` under when ``key`` is split into ``shards`` shards:
    ``f"{key}#{n}"``, where ``n`` (0 <= n < shards) depends only on ``by`` and ``shards``.

    Events with the same ``by`` keep their order; events with different ``by`` may overtake each
    other. Changing ``shards`` moves most values of ``by`` to another shard (see docs/sharding.md).
    """
    _check(key, shards)
    digest = hashlib.blake2b(_canonical(by), digest_size=8, person=b"outbox-shard").digest()
    sharded = f"{key}{SEPARATOR}{int.from_bytes(digest, 'big') % shards}"
    if len(sharded.encode()) > MAX_KEY_BYTES:
        raise InvalidEvent(f"key {key[:100]!r} is too long to shard: with its shard suffix it is "
                           f"{len(sharded.encode())} bytes; the limit is {MAX_KEY_BYTES}")
    return sharded


def shards_of(key: str, shards: int) -> list[str]:
    """Every shard key of ``key`` split into ``shards`` shards, in shard order: what a consumer
    reads or merges to see the whole key again."""
    _check(key, shards)
    return [f"{key}{SEPARATOR}{n}" for n in range(shards)]


def _check(key: str, shards: int) -> None:
    if not isinstance(key, str) or not key:
        raise InvalidEvent(f"a key to shard is a non-empty string, not {key!r}")
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise InvalidEvent(f"shards must be an integer from 1 to {MAX_SHARDS} (a sink's buckets), not {shards!r}")


def _canonical(by: SubKey) -> bytes:
    """The bytes a sub-key is hashed as: one spelling per value (an int as its decimal digits, a UUID
    in its canonical hex form, text as UTF-8), so that 42 and "42" land in the same shard."""
    if isinstance(by, bool):  # an int subclass; True would hash as "True", which no one means
        raise InvalidEvent(f"a shard sub-key is a string, integer, UUID or bytes, not {by!r}")
    if isinstance(by, bytes):
        return by
    if isinstance(by, str | int | uuid.UUID):
        return str(by).encode()
    raise InvalidEvent(f"a shard sub-key is a string, integer, UUID or bytes, not {type(by).__name__}")
