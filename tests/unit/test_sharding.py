"""Hot-key sharding (outbox_relay/sharding.py): a sub-key's shard never changes, across processes and
releases; shards_of lists exactly the keys shard_key can return; bad input is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections import Counter

import pytest

from outbox_relay.errors import InvalidEvent
from outbox_relay.event import MAX_KEY_BYTES
from outbox_relay.sharding import MAX_SHARDS, shard_key, shards_of

# Pinned: stored events, Kafka message keys and consumers' state depend on these. A change here is a
# breaking change for every user who shards, whatever the reason.
PINNED = [
    ("line-1", 8, "order:9182#1"),
    ("line-1", 16, "order:9182#9"),
    ("line-1", 256, "order:9182#153"),
    ("line-2", 8, "order:9182#6"),
    ("item:42", 16, "order:9182#13"),
    (42, 8, "order:9182#6"),
    (42, 256, "order:9182#94"),
    (uuid.UUID("12345678-1234-5678-1234-567812345678"), 256, "order:9182#237"),
    (b"\x00\xff", 8, "order:9182#1"),
    ("ключ", 256, "order:9182#184"),
]


@pytest.mark.parametrize(("by", "shards", "expected"), PINNED)
def test_the_shard_of_a_sub_key_is_pinned(by: str | int | bytes | uuid.UUID, shards: int, expected: str) -> None:
    assert shard_key("order:9182", shards, by) == expected


def test_the_shard_does_not_depend_on_the_process() -> None:
    # Python's own hash() of a str changes with PYTHONHASHSEED; the shard must not.
    code = ("from outbox_relay.sharding import shard_key; "
            "print(','.join(shard_key('order:9182', 64, f'line-{i}') for i in range(50)))")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "random")}
    assert outputs == {",".join(shard_key("order:9182", 64, f"line-{i}") for i in range(50)) + "\n"}


def test_one_spelling_per_value() -> None:
    u = uuid.uuid4()
    assert shard_key("k", 32, 42) == shard_key("k", 32, "42") == shard_key("k", 32, b"42")
    assert shard_key("k", 32, u) == shard_key("k", 32, str(u))


def test_the_shard_depends_only_on_the_sub_key_and_the_count() -> None:
    # The same line item of two orders lands in the same shard number: the key is not hashed.
    assert shard_key("order:1", 8, "line-7").rsplit("#", 1)[1] == shard_key("order:2", 8, "line-7").rsplit("#", 1)[1]


def test_shards_of_lists_every_shard_the_helper_can_return_and_only_those() -> None:
    keys = shards_of("order:9182", 8)
    assert keys == [f"order:9182#{n}" for n in range(8)]
    used = Counter(shard_key("order:9182", 8, f"line-{i}") for i in range(8000))
    assert set(used) == set(keys)
    # Spread evenly: about 1000 each (a fixed input set, so this is deterministic, not a flaky statistic).
    assert min(used.values()) > 850 and max(used.values()) < 1150, used


def test_one_shard_is_still_a_shard_key() -> None:
    assert shard_key("k", 1, "anything") == "k#0"
    assert shards_of("k", 1) == ["k#0"]


@pytest.mark.parametrize(("key", "shards", "by", "message"), [
    ("", 8, "x", "non-empty string"),
    (None, 8, "x", "non-empty string"),
    ("k", 0, "x", "shards must be an integer from 1 to 256"),
    ("k", MAX_SHARDS + 1, "x", "from 1 to 256"),
    ("k", 2.0, "x", "not 2.0"),
    ("k", True, "x", "not True"),
    ("k", 8, True, "not True"),
    ("k", 8, 1.5, "not float"),
    ("k", 8, None, "not NoneType"),
])
def test_bad_input_is_refused_by_name(key: object, shards: object, by: object, message: str) -> None:
    with pytest.raises(InvalidEvent, match=message):
        shard_key(key, shards, by)  # type: ignore[arg-type]


def test_a_key_too_long_with_its_suffix_is_refused() -> None:
    key = "k" * (MAX_KEY_BYTES - 2)
    assert shard_key(key, 10, "x").endswith(tuple(f"#{n}" for n in range(10)))  # 1024 bytes: fits
    with pytest.raises(InvalidEvent, match=r"too long to shard.*1025 bytes; the limit is 1024"):
        shard_key(key + "k", 10, "x")
    with pytest.raises(InvalidEvent, match="shards must be"):
        shards_of("k", 0)
