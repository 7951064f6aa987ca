"""The checker: what the database committed against what the recorder consumed.

Pure functions over plain data (no servers), so tests/faults/test_checker.py can show that each
check fails when it should. The database is the source of truth: ``committed`` is every row of
outbox.events at the end of the run (retention off), ``dead`` its dead letters.

- **No loss**: every committed event was consumed at least once, or is dead-lettered (listed with
  its reason).
- **No phantoms**: every consumed ``ce_id`` is a committed event, with the same key and sequence
  number in its payload.
- **Per-key order**: per key, the events in order of first occurrence on the topic (incarnation,
  then offset; a key lives in one partition) have increasing sequence numbers, i.e. equal the
  published order with the lost ones left out. A key found in two partitions of one incarnation is
  reported too.
- **Producer sequences**: per key the committed sequence numbers run 1..N with no gap. A gap means
  the database lost a commit a producer saw succeed; the run is then not evidence of anything.
- **Duplicate rate**: consumed / distinct.
- **Recovery per fault**: an event is *late* if its first consumption came more than
  ``threshold`` seconds after its commit (``created_at``). Fault ``f`` at ``t_f`` owns the events
  committed in ``[t_f - threshold, t_next - threshold)`` (those in flight at the fault, and those
  committed until the next fault). Its recovery time is the time from ``t_f`` until the last of its
  late events arrived: when delivery was healthy again. No late event: 0. A fault injected before
  delivery had recovered from the previous one is left out of the per-kind recovery figures (its
  recovery is mixed with the previous one's), and counted as overlapped. Duplicates a fault
  caused are the repeated records consumed in ``[t_f, t_next)``; its lost events are the lost ones
  it owns.
- **Wait after a fault ends**: of the events committed before fault ``f`` ended and consumed after,
  the longest time from its end until one arrived (the key that waited longest): how long the relays
  took to catch up once the fault was over. A later fault that starts meanwhile is counted in, and
  the wait is marked overlapped.
- **Stalls**: an event that waited more than ``stall`` seconds while no fault was active (from the
  later of its commit and the end of the last fault before it arrived), grouped into episodes that
  overlap in time: delivery stopped with nothing injected to explain it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tests.faults.recorder import Record


@dataclass(frozen=True)
class Committed:
    event_id: str
    key: str
    producer: int
    n: int
    created_at: float  # epoch seconds (the transaction's start, ~its commit for short transactions)


@dataclass(frozen=True)
class DeadLetter:
    event_id: str
    sink: str
    attempts: int
    last_error: str


@dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    target: str
    detail: str
    started: float  # epoch seconds
    ended: float  # when the injection was over (a stop lasts until SIGCONT)
    # False: injected before delivery had recovered from the previous fault (the wait ran out),
    # so its recovery can not be told apart from the previous one's: left out of the medians.
    healthy_before: bool = True


@dataclass
class FaultResult:
    fault: Fault
    recovery: float = 0.0  # seconds from the fault until its last late event arrived
    late: int = 0
    max_latency: float = 0.0
    duplicates: int = 0
    lost: int = 0
    wait_after_end: float = 0.0  # seconds from the fault's end until the last event pending then arrived
    # Another fault was active at some point of that wait (so the wait is not this fault's alone).
    wait_overlapped: bool = False


@dataclass(frozen=True)
class Stall:
    started: float  # epoch seconds: the earliest wait of the episode began (a commit, or a fault's end)
    ended: float  # the last of its events arrived
    events: int  # events that waited longer than the stall threshold in it
    longest: float  # seconds


@dataclass
class KindSummary:
    kind: str
    count: int
    recovery_median: float | None  # None: every fault of the kind overlapped the previous one's recovery
    recovery_max: float | None
    overlapped: int  # faults injected before delivery had recovered from the previous one
    late: int
    duplicates: int
    lost: int


@dataclass(frozen=True)
class Lost:
    event_id: str
    key: str
    n: int
    created_at: float
    fault: int | None  # the index of the fault that owns it (None: before the first)


@dataclass(frozen=True)
class Reorder:
    key: str
    got: tuple[int, ...]  # sequence numbers around the first inversion, in topic order
    where: tuple[tuple[int, int, int], ...]  # (incarnation, partition, offset) of those records


@dataclass
class Result:
    committed: int = 0
    consumed: int = 0
    distinct: int = 0
    lost: list[Lost] = field(default_factory=list)
    dead_lettered: list[DeadLetter] = field(default_factory=list)
    phantoms: list[Record] = field(default_factory=list)  # ce_id not committed
    mismatched: list[Record] = field(default_factory=list)  # committed id, other key or n in the payload
    reordered: list[Reorder] = field(default_factory=list)
    split_keys: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # key -> [(inc, partition)]
    sequence_gaps: dict[str, list[int]] = field(default_factory=dict)  # key -> missing n
    baseline: FaultResult | None = None  # before the first fault
    faults: list[FaultResult] = field(default_factory=list)
    kinds: list[KindSummary] = field(default_factory=list)
    latency_p50: float = 0.0  # of events owned by no fault with late events (healthy delivery)
    latency_p99: float = 0.0
    threshold: float = 1.0
    stalls: list[Stall] = field(default_factory=list)
    stall_threshold: float = 5.0

    @property
    def duplicate_rate(self) -> float:
        return self.consumed / self.distinct if self.distinct else 0.0

    @property
    def duplicates_percent(self) -> float:
        """Extra copies as a share of the distinct events (a rate of 1.05 is 5 %)."""
        return 100.0 * (self.consumed - self.distinct) / self.distinct if self.distinct else 0.0

    @property
    def passed(self) -> bool:
        return not (self.lost or self.phantoms or self.mismatched or self.reordered or self.split_keys
                    or self.sequence_gaps)

    def problems(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{len(self.lost)} committed events never consumed and not dead-lettered")
        if self.phantoms:
            out.append(f"{len(self.phantoms)} consumed messages whose ce_id was never committed")
        if self.mismatched:
            out.append(f"{len(self.mismatched)} consumed messages whose payload differs from the committed event")
        if self.reordered:
            out.append(f"{len(self.reordered)} keys out of order after de-duplication")
        if self.split_keys:
            out.append(f"{len(self.split_keys)} keys found in more than one partition of one topic incarnation")
        if self.sequence_gaps:
            out.append(f"{len(self.sequence_gaps)} keys with committed sequence gaps (the database lost a commit)")
        return out


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def check(committed: Iterable[Committed], dead: Iterable[DeadLetter], records: Sequence[Record],
          faults: Sequence[Fault], *, threshold: float = 1.0, stall: float = 5.0) -> Result:
    events = {c.event_id: c for c in committed}
    dead_by_id = {d.event_id: d for d in dead}
    result = Result(committed=len(events), consumed=len(records), threshold=threshold, stall_threshold=stall)

    first_seen: dict[str, float] = {}
    for r in records:
        c = events.get(r.event_id)
        if c is None:
            result.phantoms.append(r)
            continue
        if (r.key, r.n) != (c.key, c.n):
            result.mismatched.append(r)
        if r.event_id not in first_seen or r.consumed_at < first_seen[r.event_id]:
            first_seen[r.event_id] = r.consumed_at
    result.distinct = len({r.event_id for r in records})

    result.sequence_gaps = _sequence_gaps(events.values())
    result.reordered, result.split_keys = _order(records, events)

    # Fault windows: fault i owns commits in [start_i, start_{i+1}) and consumptions in
    # [t_i, t_{i+1}); "before the first fault" is index None.
    ordered = sorted(faults, key=lambda f: f.started)
    starts = [f.started for f in ordered]
    results = [FaultResult(f) for f in ordered]
    baseline = FaultResult(Fault(-1, "baseline", "", "before the first fault", 0.0, 0.0))

    def owner_by_commit(t: float) -> FaultResult:
        i = _last_at_or_before(starts, t + threshold)
        return baseline if i is None else results[i]

    def owner_by_consume(t: float) -> FaultResult:
        i = _last_at_or_before(starts, t)
        return baseline if i is None else results[i]

    latencies_by_owner: dict[int, list[float]] = {}
    for event_id, c in events.items():
        owner = owner_by_commit(c.created_at)
        consumed_at = first_seen.get(event_id)
        if consumed_at is None:
            if event_id in dead_by_id:
                continue
            owner.lost += 1
            result.lost.append(Lost(event_id, c.key, c.n, c.created_at, owner.fault.index if owner is not baseline
                                    else None))
            continue
        latency = consumed_at - c.created_at
        latencies_by_owner.setdefault(owner.fault.index, []).append(latency)
        owner.max_latency = max(owner.max_latency, latency)
        if latency > threshold:
            owner.late += 1
            if owner is not baseline:
                owner.recovery = max(owner.recovery, consumed_at - owner.fault.started)
    result.dead_lettered = [d for d in dead_by_id.values()]

    seen_once: set[str] = set()
    for r in sorted(records, key=lambda r: r.consumed_at):
        if r.event_id in seen_once:
            owner_by_consume(r.consumed_at).duplicates += 1
        seen_once.add(r.event_id)

    # Healthy delivery: the latencies of windows that had no late event.
    healthy = [x for fr in [baseline, *results] if fr.late == 0
               for x in latencies_by_owner.get(fr.fault.index, [])]
    result.latency_p50 = percentile(healthy, 0.50)
    result.latency_p99 = percentile(healthy, 0.99)
    result.baseline = baseline
    _waits_after_end(results, events, first_seen)
    result.stalls = _stalls(ordered, events, first_seen, stall)
    result.faults = results
    result.kinds = summarise(results)
    return result


def _waits_after_end(results: Sequence[FaultResult], events: dict[str, Committed], first_seen: dict[str, float]
                     ) -> None:
    """Each fault's ``wait_after_end``: the latest first arrival among events committed before its end."""
    arrivals = sorted((events[i].created_at, t) for i, t in first_seen.items() if i in events)
    commits = [c for c, _ in arrivals]
    latest: list[float] = []  # latest[k]: the latest arrival among the first k + 1 commits
    for _, t in arrivals:
        latest.append(max(t, latest[-1]) if latest else t)
    for fr in results:
        k = _last_at_or_before(commits, fr.fault.ended)
        if k is not None:
            fr.wait_after_end = max(0.0, latest[k] - fr.fault.ended)
        end, until = fr.fault.ended, fr.fault.ended + fr.wait_after_end
        fr.wait_overlapped = any(o.fault is not fr.fault and o.fault.started <= until and o.fault.ended > end
                                 for o in results)


def _stalls(faults: Sequence[Fault], events: dict[str, Committed], first_seen: dict[str, float], stall: float
            ) -> list[Stall]:
    """Episodes of events that waited over ``stall`` seconds with no fault active (``faults`` by start)."""
    starts = [f.started for f in faults]
    ended_by: list[float] = []  # ended_by[k]: the latest end among the first k + 1 faults
    for f in faults:
        ended_by.append(max(f.ended, ended_by[-1]) if ended_by else f.ended)
    waits: list[tuple[float, float]] = []
    for event_id, t in first_seen.items():
        c = events.get(event_id)
        if c is None:
            continue
        k = _last_at_or_before(starts, t)
        last_end = ended_by[k] if k is not None else float("-inf")
        if last_end > t:
            continue  # a fault was active when it arrived
        since = max(c.created_at, last_end)
        if t - since > stall:
            waits.append((since, t))
    out: list[Stall] = []
    for since, t in sorted(waits):
        if out and since <= out[-1].ended:
            last = out[-1]
            out[-1] = Stall(last.started, max(last.ended, t), last.events + 1, max(last.longest, t - since))
        else:
            out.append(Stall(since, t, 1, t - since))
    return out


def summarise(results: Sequence[FaultResult]) -> list[KindSummary]:
    kinds: dict[str, list[FaultResult]] = {}
    for fr in results:
        kinds.setdefault(fr.fault.kind, []).append(fr)
    out = []
    for kind, frs in sorted(kinds.items()):
        recoveries = [fr.recovery for fr in frs if fr.fault.healthy_before]
        out.append(KindSummary(kind, len(frs), statistics.median(recoveries) if recoveries else None,
                               max(recoveries) if recoveries else None, len(frs) - len(recoveries),
                               sum(fr.late for fr in frs), sum(fr.duplicates for fr in frs),
                               sum(fr.lost for fr in frs)))
    return out


def _last_at_or_before(starts: Sequence[float], t: float) -> int | None:
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1 if lo > 0 else None


def _sequence_gaps(events: Iterable[Committed]) -> dict[str, list[int]]:
    per_key: dict[str, set[int]] = {}
    for c in events:
        per_key.setdefault(c.key, set()).add(c.n)
    gaps = {}
    for key, ns in per_key.items():
        missing = sorted(set(range(1, max(ns) + 1)) - ns)
        if missing:
            gaps[key] = missing
    return gaps


def _order(records: Sequence[Record], events: dict[str, Committed]
           ) -> tuple[list[Reorder], dict[str, list[tuple[int, int]]]]:
    by_key: dict[str, list[Record]] = {}
    for r in records:
        if r.event_id in events:
            by_key.setdefault(events[r.event_id].key, []).append(r)
    reordered: list[Reorder] = []
    split: dict[str, list[tuple[int, int]]] = {}
    for key, rs in by_key.items():
        places = sorted({(r.incarnation, r.partition) for r in rs})
        if len({i for i, _ in places}) < len(places):
            split[key] = places
        seen: set[str] = set()
        firsts: list[Record] = []
        for r in sorted(rs, key=lambda r: (r.incarnation, r.partition, r.offset)):
            if r.event_id not in seen:
                seen.add(r.event_id)
                firsts.append(r)
        ns = [events[r.event_id].n for r in firsts]
        for i in range(1, len(ns)):
            if ns[i] <= ns[i - 1]:
                window = firsts[max(0, i - 2):i + 2]
                reordered.append(Reorder(key, tuple(events[r.event_id].n for r in window),
                                         tuple((r.incarnation, r.partition, r.offset) for r in window)))
                break
    return reordered, split
