"""The recorder: consumes every partition of the topic and keeps every message it sees.

It uses ``assign()`` (a group join takes ~20 s on Tansu) from offset 0 and never trusts the
broker's end offsets (Tansu's can be wrong). Each message becomes a ``Record`` with the time it
was consumed; duplicates are kept (the checker counts them).

Two Tansu facts shape it:

- A fetch can skip a batch whose offset was reserved but not yet written while several producers
  write one partition. Offsets of a plain (non-transactional) topic are contiguous, so a skip
  shows as a gap: a second consumer re-reads gaps shortly after they appear, and ``drain()``
  re-reads the whole topic from offset 0 before anything is called lost.
- Storage is memory only: a broker restart starts a new, empty topic. Before one, the controller
  calls ``drain()`` (the relays held back meanwhile), then ``end_incarnation()``; after it,
  ``begin_incarnation()`` reads the new topic from offset 0. Records carry their incarnation, and
  offsets are compared only within one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

log = logging.getLogger("tests.faults.recorder")

CLIENT_ID = "faults-recorder"  # the proxies exempt client ids starting "faults-"
FILL_AFTER = 0.3  # a gap older than this is re-read by the filler
FILL_ATTEMPTS = 5  # then it is left to the full re-read at the next drain


@dataclass(frozen=True)
class Record:
    incarnation: int
    partition: int
    offset: int
    event_id: str  # the ce_id header ("" if absent)
    key: str
    producer: int  # from the payload (-1 if unreadable)
    n: int  # the key's sequence number from the payload (-1 if unreadable)
    fence: int  # the outbox_fence header (-1 if absent)
    consumed_at: float  # wall clock (time.time()) when the recorder got it
    reread: bool = False  # found by a re-read (a fetch skipped it), not by the live consumer


@dataclass
class RecorderStats:
    consume_errors: dict[str, int] = field(default_factory=dict)
    gaps_seen: int = 0  # offsets the live consumer skipped (each counted once)
    filled: int = 0  # records found by the gap filler
    reread_found: int = 0  # records found only by a full re-read from offset 0
    gaps_left: int = 0  # offsets never seen in any incarnation (after the final re-read)


def _consumer(bootstrap: str, client_id: str) -> Consumer:
    return Consumer({
        "bootstrap.servers": bootstrap,
        "client.id": client_id,
        "group.id": f"faults-{uuid.uuid4().hex[:8]}",  # required by the client; never joined
        "enable.auto.commit": False,
        "enable.partition.eof": False,
        "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": 20,
        "log_level": 3,
    })


def _where(m: Any) -> tuple[int, int]:
    return int(m.partition()), int(m.offset())


def _decode(m: Any, incarnation: int, reread: bool) -> Record:
    headers = {k: v for k, v in (m.headers() or [])}
    key = m.key()
    producer = n = -1
    try:
        payload = json.loads(m.value())
        producer, n = int(payload["producer"]), int(payload["n"])
    except (ValueError, TypeError, KeyError):
        pass
    fence = headers.get("outbox_fence")
    return Record(
        incarnation=incarnation, partition=m.partition(), offset=m.offset(),
        event_id=(headers.get("ce_id") or b"").decode(errors="replace"),
        key=key.decode(errors="replace") if key is not None else "",
        producer=producer, n=n, fence=int(fence) if fence and fence.isdigit() else -1,
        consumed_at=time.time(), reread=reread,
    )


class Recorder:
    def __init__(self, bootstrap: str, topic: str, partitions: int, *, ignore_one_in: int = 0) -> None:
        self.bootstrap = bootstrap
        # Testing the suite itself: pretend never to see 1 in N events (by id, so every read agrees).
        self.ignore_one_in = ignore_one_in
        self.topic = topic
        self.partitions = partitions
        self.stats = RecorderStats()
        self.records: list[Record] = []
        self.incarnation = 0
        self._lock = threading.Lock()
        self._ids: set[str] = set()  # event ids seen so far (any incarnation)
        self._offsets: dict[tuple[int, int], set[int]] = {}  # (incarnation, partition) -> offsets seen
        self._top: dict[tuple[int, int], int] = {}  # (incarnation, partition) -> highest offset seen
        self._gap_tries: dict[tuple[int, int, int], int] = {}  # (incarnation, partition, offset) -> fills
        self._last_new = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def begin_incarnation(self) -> None:
        """Start reading the (new) topic from offset 0 in a thread."""
        # Each incarnation's thread has its own stop event: one that is slow to close can never
        # go on reading the next topic under the old incarnation number.
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self.incarnation, self._stop),
                                        name=f"recorder-{self.incarnation}", daemon=True)
        self._thread.start()

    def end_incarnation(self) -> None:
        """Stop reading this topic (the broker lost it); the next one is a new incarnation."""
        self.stop()
        self.incarnation += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)
            if self._thread.is_alive():
                log.warning("recorder: the consumer of incarnation %d did not stop within 15s", self.incarnation)

    # -- queries (any thread) -------------------------------------------------------------

    def missing(self, event_ids: Iterable[str]) -> list[str]:
        with self._lock:
            return [i for i in event_ids if i not in self._ids]

    def count(self) -> int:
        with self._lock:
            return len(self.records)

    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self.records)

    def gaps(self, incarnation: int | None = None) -> dict[int, list[int]]:
        """Per partition, offsets below the highest one seen that were not seen."""
        inc = self.incarnation if incarnation is None else incarnation
        out: dict[int, list[int]] = {}
        with self._lock:
            for (i, p), seen in self._offsets.items():
                top = self._top.get((i, p), -1)
                if i == inc and len(seen) != top + 1:  # offsets start at 0 and are contiguous
                    out[p] = sorted(set(range(top + 1)) - seen)
        return out

    # -- the live consumer ----------------------------------------------------------------

    def _add(self, messages: list[Any], incarnation: int, reread: bool) -> int:
        """Keep the new ones (by incarnation, partition, offset); returns how many were new."""
        new = 0
        with self._lock:
            for m in messages:
                if m.error():
                    name = m.error().name()
                    self.stats.consume_errors[name] = self.stats.consume_errors.get(name, 0) + 1
                    continue
                where = (incarnation, m.partition())
                seen = self._offsets.setdefault(where, set())
                if m.offset() in seen:
                    continue
                top = self._top.get(where, -1)
                if not reread and m.offset() > top + 1:
                    self.stats.gaps_seen += m.offset() - top - 1
                self._top[where] = max(top, m.offset())
                seen.add(m.offset())
                record = _decode(m, incarnation, reread)
                if self.ignore_one_in and uuid.UUID(record.event_id).int % self.ignore_one_in == 0:
                    continue
                self.records.append(record)
                self._ids.add(record.event_id)
                new += 1
            if new:
                self._last_new = time.monotonic()
        return new

    def _run(self, incarnation: int, stop: threading.Event) -> None:
        consumer = _consumer(self.bootstrap, CLIENT_ID)
        filler: Consumer | None = None
        try:
            consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in range(self.partitions)])
            next_fill = time.monotonic() + FILL_AFTER
            while not stop.is_set():
                self._add(consumer.consume(num_messages=1000, timeout=0.05), incarnation, reread=False)
                if time.monotonic() >= next_fill:
                    next_fill = time.monotonic() + FILL_AFTER
                    filler = self._fill(filler, incarnation)
        except Exception:
            log.exception("recorder: the consumer of incarnation %d failed", incarnation)
            raise
        finally:
            consumer.close()
            if filler is not None:
                filler.close()

    def _fill(self, filler: Consumer | None, incarnation: int) -> Consumer | None:
        """Re-read the gaps the live consumer left (a skipped batch), from their first offset."""
        todo: dict[int, tuple[int, int]] = {}  # partition -> (first gap offset, highest seen)
        for p, missing in self.gaps(incarnation).items():
            tries = [self._gap_tries.get((incarnation, p, o), 0) for o in missing]
            fresh = [o for o, t in zip(missing, tries, strict=True) if t < FILL_ATTEMPTS]
            if fresh:
                with self._lock:
                    top = self._top[(incarnation, p)]
                todo[p] = (fresh[0], top)
                for o in fresh:
                    self._gap_tries[(incarnation, p, o)] = self._gap_tries.get((incarnation, p, o), 0) + 1
        if not todo:
            return filler
        if filler is None:
            filler = _consumer(self.bootstrap, CLIENT_ID + "-filler")
        filler.assign([TopicPartition(self.topic, p, first) for p, (first, _) in todo.items()])
        reached = {p: first - 1 for p, (first, _) in todo.items()}
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(reached[p] < top for p, (_, top) in todo.items()):
            messages = filler.consume(num_messages=1000, timeout=0.05)
            for m in messages:
                if not m.error():
                    p, o = _where(m)
                    reached[p] = max(reached.get(p, -1), o)
            found = self._add(messages, incarnation, reread=True)
            with self._lock:
                self.stats.filled += found
        return filler

    # -- barriers -------------------------------------------------------------------------

    def drain(self, quiet: float = 0.5, timeout: float = 60.0) -> int:
        """Wait until nothing new arrived for ``quiet`` seconds, then re-read the current topic from
        offset 0 (a fetch may have skipped a batch). Returns how many records only the re-read found."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                idle = time.monotonic() - self._last_new
            if idle >= quiet:
                break
            time.sleep(min(0.05, quiet - idle))
        return self.reread(max(1.0, deadline - time.monotonic()))

    def reread(self, timeout: float = 30.0, quiet: float = 0.5) -> int:
        """Read every partition of the current incarnation from offset 0 to past the highest offset
        seen, then ``quiet`` seconds more; returns how many records were new."""
        incarnation = self.incarnation
        with self._lock:
            tops = {p: self._top.get((incarnation, p), -1) for p in range(self.partitions)}
        consumer = _consumer(self.bootstrap, CLIENT_ID + "-reread")
        found = 0
        try:
            consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in range(self.partitions)])
            reached = dict.fromkeys(range(self.partitions), -1)
            deadline = time.monotonic() + timeout
            last_new = time.monotonic()
            while time.monotonic() < deadline:
                messages = consumer.consume(num_messages=1000, timeout=0.05)
                for m in messages:
                    if not m.error():
                        p, o = _where(m)
                        reached[p] = max(reached[p], o)
                        last_new = time.monotonic()
                found += self._add(messages, incarnation, reread=True)
                caught_up = all(reached[p] >= top for p, top in tops.items())
                if caught_up and time.monotonic() - last_new >= quiet:
                    break
            else:
                log.warning("recorder: the re-read of incarnation %d did not reach offsets %s within %.0fs "
                            "(reached %s)", incarnation, tops, timeout, reached)
        finally:
            consumer.close()
        with self._lock:
            self.stats.reread_found += found
        return found

    def finish(self) -> None:
        """After the final drain: count the offsets no read ever returned."""
        self.stop()
        total = 0
        for inc in range(self.incarnation + 1):
            total += sum(len(v) for v in self.gaps(inc).values())
        self.stats.gaps_left = total
