"""The run's report, as markdown: the machine, the command, the seed, a table per fault kind,
totals, every fault, and what went wrong (lost events, reordered keys, relay log lines)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.faults.checker import Fault, FaultResult, Result
from tests.faults.recorder import RecorderStats

ROOT = Path(__file__).resolve().parents[2]

_LOG_LINE = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) (\S+) \[worker=\S+ ([^\]]*)\] (.*)$")
_VARYING = [
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), "<uuid>"),
    (re.compile(r"\br\d+-\d+\b"), "<worker>"),
    (re.compile(r"0x[0-9a-f]+"), "<address>"),
    (re.compile(r"127\.0\.0\.1"), "<localhost>"),
    (re.compile(r"\d+(\.\d+)?"), "N"),
]


@dataclass
class LogSummary:
    lines: int
    by_level: dict[str, int]
    top: list[tuple[str, int]]  # normalised "LEVEL logger: message" -> count
    tracebacks: int


def scan_logs(log_dir: Path) -> LogSummary:
    """Warnings and errors of every relay log, with numbers, ids and worker names folded."""
    counts: Counter[str] = Counter()
    levels: Counter[str] = Counter()
    lines = tracebacks = 0
    for path in sorted(log_dir.glob("relay-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            lines += 1
            if line.startswith("Traceback"):
                tracebacks += 1
            m = _LOG_LINE.match(line)
            if not m:
                continue
            level, logger, _thread, message = m.groups()
            levels[level] += 1
            for pattern, repl in _VARYING:
                message = pattern.sub(repl, message)
            counts[f"{level} {logger}: {message[:160]}"] += 1
    return LogSummary(lines, dict(levels), counts.most_common(15), tracebacks)


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (WARNING|ERROR|CRITICAL) ")


def warnings_between(log_dir: Path, start: float, end: float) -> list[str]:
    """The relays' WARNING and ERROR lines logged in [start, end] (epoch seconds; logs use local time)."""
    out = []
    for path in sorted(log_dir.glob("relay-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            m = _STAMP.match(line)
            if m and start <= time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1000 <= end:
                out.append(line)
    return out


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal"))
        mem = f"{mem_kb / 1024 / 1024:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        mem = "?"
    return (f"{os.cpu_count()} cores ({model or platform.processor() or '?'}), {mem}, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}")


def revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=ROOT, timeout=10).stdout.strip()
        return rev + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def _s(x: float) -> str:
    return f"{x:.1f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> list[str]:
    align = ["---:" if i in right else "---" for i in range(len(headers))]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


def render(*, config: Any, kinds: list[str], result: Result, faults: Sequence[Fault], waits: Sequence[float | None],
           notes: list[str], findings: list[str], database: Any, broker_version: str,
           recorder_stats: RecorderStats, incarnations: int, producers: list[dict[str, Any]],
           drained_after: float | None, lag_json: str,
           relay_exit_codes: dict[str, int | None], unexpected: list[tuple[str, int | None]], t0: float,
           phase_seconds: float, relay_logs: LogSummary, workdir: Path, proxy_stats: dict[str, Any],
           passed: bool, started_at: float, loadavg: tuple[str, str], lease_seconds: float = 3.0) -> str:
    lines: list[str] = []
    add = lines.append
    add("# Fault injection: outbox-relay under faults")
    add("")
    add("Real `outbox-relay run` processes, real PostgreSQL and a real Kafka-protocol broker (Tansu), faults "
        "injected from outside, a recorder consuming the topic, and a checker of no loss, no phantoms and per-key "
        "order, with the duplicates and the recovery time of each fault. This page is the report of one run, "
        "written by the command below; run it yourself with `python -m tests.faults --seconds 120 --faults 50` "
        "(`--help` lists the options; the exit code is 0 only if the checker passed). CI runs a short version: "
        "tests/acceptance/test_fault_injection.py. The code is in tests/faults/; how to read the figures is at "
        "the end of this page.")
    add("")
    add(f"- **Command:** `{config.command}`")
    add(f"- **Seed:** {config.seed} (the same seed replays the same faults, targets and durations)")
    add(f"- **When:** {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(started_at))}, "
        f"code at {revision()}")
    add(f"- **Machine:** {machine()}; load average {loadavg[0]} at the start, {loadavg[1]} at the end "
        "(the machine is shared)")
    add(f"- **Servers:** PostgreSQL {database.version} ({database.server.kind}, synchronous_commit="
        f"{database.synchronous_commit}), {broker_version} (memory storage)")
    add(f"- **Load:** {config.rate:g} events/s from {config.producers} producer processes x "
        f"{config.producer_threads} threads over {config.keys} keys, 1-5 events per transaction; "
        f"{config.relays} relays (`outbox-relay run` with the test knobs of CONTRIBUTING.md, retention off"
        + (f", plus `{' '.join(config.relay_options)}`" if config.relay_options else "") + f"); topic with "
        f"{config.partitions} partitions")
    add(f"- **Faults:** {len(faults)} over a planned {config.seconds:g} s; the fault phase took "
        f"{phase_seconds:.0f} s (each fault waits until delivery recovered from the previous one, at most "
        f"{config.max_wait:g} s). Late means consumed more than {config.threshold:g} s after commit.")
    for note in notes:
        add(f"- **Note:** {note}")
    add("")

    add("## Verdict")
    add("")
    problems = result.problems()
    if drained_after is None:
        problems.append(f"the relays did not drain within {config.drain_timeout:g} s after the load stopped")
    for worker, code in unexpected:
        problems.append(f"relay {worker} exited on its own (exit code {code})")
    problems += findings
    bad_exits = {w: c for w, c in relay_exit_codes.items() if c != 0}
    if bad_exits:
        problems.append(f"relays that did not exit 0 on the final SIGTERM: {bad_exits}")
    add("**PASSED**: no loss, no phantoms, per-key order kept." if passed and not problems else
        "**FAILED**: " + "; ".join(problems) + ".")
    add("")

    add("## Totals")
    add("")
    dead = len(result.dead_lettered)
    lines += _table(
        ["committed events", "consumed messages", "distinct consumed", "lost", "dead-lettered", "phantoms",
         "reordered keys", "duplicate rate"],
        [[result.committed, result.consumed, result.distinct, len(result.lost), dead,
          len(result.phantoms) + len(result.mismatched), len(result.reordered), f"{result.duplicate_rate:.4f}"]],
        right=range(8))
    add("")
    add(f"- Latency from commit to consumption where no fault delayed anything: p50 "
        f"{result.latency_p50 * 1000:.0f} ms, p99 {result.latency_p99 * 1000:.0f} ms.")
    add(f"- The relays drained the backlog {_s(drained_after) + ' s' if drained_after is not None else 'NOT'} "
        "after the producers stopped.")
    add(f"- Recorder: {incarnations} topic incarnations (one per broker start); the live consumer skipped "
        f"{recorder_stats.gaps_seen} offsets (Tansu's fetch skipping a batch), the gap re-reads found "
        f"{recorder_stats.filled} and the re-reads from offset 0 {recorder_stats.reread_found} more; offsets never "
        f"read: {recorder_stats.gaps_left}.")
    if result.split_keys:
        add(f"- Keys in two partitions of one incarnation: {len(result.split_keys)}, e.g. "
            f"{dict(list(result.split_keys.items())[:3])}")
    if result.sequence_gaps:
        add(f"- Committed sequence gaps (the database lost commits): {dict(list(result.sequence_gaps.items())[:5])}")
    add("")

    lines += _goals(result, faults, lease_seconds, workdir / "relays", t0)

    add("## Per fault kind")
    add("")
    rows = [[k.kind, k.count, "n/a" if k.recovery_median is None else _s(k.recovery_median),
             "n/a" if k.recovery_max is None else _s(k.recovery_max), k.overlapped, k.late, k.duplicates, k.lost]
            for k in result.kinds]
    base = result.baseline
    if base is not None:
        rows.append(["(before the first fault)", "", "", "", "", base.late, base.duplicates, base.lost])
    lines += _table(["fault", "count", "recovery median (s)", "recovery max (s)", "overlapped", "late events",
                     "duplicates caused", "lost"], rows, right=range(1, 8))
    add("")
    add("*overlapped*: injected before delivery had recovered from the previous fault (the wait ran out); "
        "left out of the recovery columns, since its recovery is mixed with the previous one's.")
    add("")

    add("## Every fault")
    add("")
    rows = []
    for fr, waited in zip(result.faults, waits, strict=False):
        f = fr.fault
        rows.append([f.index, _s(f.started - t0), f.kind, f.target, f.detail, _s(f.ended - f.started),
                     _s(fr.recovery), _s(fr.wait_after_end) + ("*" if fr.wait_overlapped else ""), fr.late,
                     fr.duplicates, fr.lost,
                     "-" if waited is None else _s(waited)])
    lines += _table(["#", "at (s)", "fault", "target", "what was done", "lasted (s)", "recovery (s)",
                     "wait after end (s)", "late", "dups", "lost", "health wait (s)"], rows,
                    right=(0, 1, 5, 6, 7, 8, 9, 10, 11))
    add("")
    add(f"*at*: seconds since the load started. *lasted*: the injection itself (a SIGSTOP until its SIGCONT, a "
        "restart until the server was back); recovery counts from its start. *health wait*: how long the fault "
        "waited after its planned time until the events committed since the previous fault ended arrived within "
        f"{config.threshold:g} s "
        f"('-': they did not within {config.max_wait:g} s, so the fault was injected anyway and overlaps the "
        "previous one). *wait after end*: the longest an event committed before the fault ended waited after "
        "its end (a later fault that began meanwhile is counted in: marked *).")
    add("")

    if result.lost:
        add("## Lost events")
        add("")
        by_fault = Counter(lost.fault for lost in result.lost)
        add("Committed, never consumed, not dead-lettered. By the fault that owns them: "
            + ", ".join(f"#{k if k is not None else '-'} ({_kind(result.faults, k)}): {v}"
                        for k, v in sorted(by_fault.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))) + ".")
        add("")
        rows = [[x.event_id, x.key, x.n, _s(x.created_at - t0), x.fault if x.fault is not None else "-"]
                for x in sorted(result.lost, key=lambda x: x.created_at)[:20]]
        lines += _table(["event id", "key", "n", "committed at (s)", "fault"], rows, right=(2, 3, 4))
        add("")
    if result.dead_lettered:
        add("## Dead letters")
        add("")
        reasons = Counter(d.last_error[:120] for d in result.dead_lettered)
        lines += _table(["reason", "events"], [[r, n] for r, n in reasons.most_common(10)], right=(1,))
        add("")
    if result.reordered:
        add("## Keys out of order (first 10)")
        add("")
        rows = [[r.key, " ".join(map(str, r.got)), " ".join(f"{i}/{p}/{o}" for i, p, o in r.where)]
                for r in result.reordered[:10]]
        lines += _table(["key", "sequence numbers in topic order", "incarnation/partition/offset"], rows)
        add("")
    if result.phantoms or result.mismatched:
        add("## Phantoms (first 10)")
        add("")
        rows = [[r.event_id, r.key, r.n, f"{r.incarnation}/{r.partition}/{r.offset}"]
                for r in (result.phantoms + result.mismatched)[:10]]
        lines += _table(["ce_id", "key", "n", "incarnation/partition/offset"], rows)
        add("")

    add("## Relays and producers")
    add("")
    add(f"- Exit codes at the final SIGTERM: {relay_exit_codes or '{}'}"
        + (f"; exited on their own during the run: {unexpected}" if unexpected else ""))
    levels = ", ".join(f"{n} {lvl.lower()}" for lvl, n in sorted(relay_logs.by_level.items())) or "none"
    add(f"- Relay logs: {relay_logs.lines} lines; warnings and errors: {levels}; tracebacks: "
        f"{relay_logs.tracebacks}. Most frequent (numbers folded to N):")
    add("")
    lines += _table(["count", "log line"], [[n, f"`{line}`"] for line, n in relay_logs.top], right=(0,))
    add("")
    for s in producers:
        add(f"- Producer {s.get('producer')}: {s.get('events', '?')} events in {s.get('transactions', '?')} "
            f"transactions; {s.get('failed_attempts', '?')} failed attempts retried ({s.get('errors') or {}}), "
            f"{s.get('in_doubt', '?')} commits whose outcome was unknown and turned out to have happened; "
            f"exit code {s.get('exit_code')}")
    add(f"- Proxies: {proxy_stats}")
    add(f"- `outbox-relay lag --json` at the end: `{' '.join(lag_json.split())[:400]}`")
    add(f"- Logs and raw data of this run: {workdir} (relays/, producer-*.log, tansu.log; committed.jsonl, "
        "records.jsonl, faults.jsonl)")
    add("")

    add("## How to read this")
    add("")
    add("- **Source of truth**: the database. *Committed* = every row of outbox.events at the end (retention "
        "off); the recorder consumed every partition with `assign()` from offset 0, through every broker "
        "restart (a restart empties Tansu, so the topic was read to its end, re-read from offset 0, before "
        "each one), and re-read the last topic from offset 0 at the end before calling anything lost.")
    add("- **Lost**: committed, never consumed, not dead-lettered. **Phantom**: a consumed ce_id that was "
        "never committed, or whose payload differs. **Reordered key**: its events, in order of first "
        "occurrence on the topic, do not follow the producer's per-key sequence numbers. **Duplicate rate**: "
        "consumed / distinct.")
    add(f"- **Recovery** of a fault: the time from the fault until the last event it delayed arrived. An event "
        f"is late if it was consumed more than {config.threshold:g} s after its commit; a fault owns the events "
        f"committed from {config.threshold:g} s before it until {config.threshold:g} s before the next fault. 0 "
        "means no event was late. It includes the fault itself (a 5 s SIGSTOP counts from the SIGSTOP). "
        "Duplicates are attributed to the fault during whose window they were consumed, lost events to the "
        "fault that owns their commit.")
    add("- Faults: " + ", ".join(f"`{k}`" for k in kinds) + "; tests/faults/faults.py says what each does.")
    add("")
    return "\n".join(lines)


def _goals(result: Result, faults: Sequence[Fault], lease: float, log_dir: Path, t0: float) -> list[str]:
    """Issue 25's goals: duplicates, the wait after each fault ends (starvation first), silent stalls."""
    lines = ["## Duplicates, waits after faults, stalls", ""]
    starved = [fr for fr in result.faults if fr.fault.kind == "relay_starve"]
    limit = 3 * lease
    alone = [fr for fr in result.faults if not fr.wait_overlapped]
    worst = max(alone, key=lambda fr: fr.wait_after_end, default=None)
    rows: list[list[Any]] = [["duplicates (extra copies / distinct events)", f"{result.duplicates_percent:.1f} %",
                              "at most 5 %", "yes" if result.duplicates_percent <= 5.0 else "NO"]]
    for fr in starved:
        mixed = " (other faults active meanwhile)" if fr.wait_overlapped else ""
        rows.append([f"longest wait after starvation #{fr.fault.index} ended{mixed}", f"{_s(fr.wait_after_end)} s",
                     f"at most 3 leases ({limit:g} s)", "yes" if fr.wait_after_end <= limit else "NO"])
    if worst is not None:
        rows.append([f"longest wait after a fault ended, no other fault active meanwhile (#{worst.fault.index} "
                     f"{worst.fault.kind})",
                     f"{_s(worst.wait_after_end)} s", f"at most 3 leases ({limit:g} s)",
                     "yes" if worst.wait_after_end <= limit else "NO"])
    silent = []
    for st in result.stalls:
        if not warnings_between(log_dir, st.started, st.ended):
            silent.append(st)
    rows.append([f"stalls (an event waited over {result.stall_threshold:g} s, no fault active)",
                 str(len(result.stalls)), "each logged by a relay",
                 "yes" if not silent else f"NO ({len(silent)} silent)"])
    lines += _table(["", "this run", "goal", "met"], rows)
    lines.append("")
    if result.stalls:
        rows = [[_s(st.started - t0), _s(st.ended - t0), st.events, _s(st.longest),
                 len(warnings_between(log_dir, st.started, st.ended))] for st in result.stalls[:20]]
        lines += _table(["from (s)", "to (s)", "events", "longest (s)", "relay warnings meanwhile"], rows,
                        right=range(5))
        lines.append("")
    return lines


def _kind(results: Sequence[FaultResult], index: int | None) -> str:
    if index is None:
        return "before the first fault"
    return next((fr.fault.kind for fr in results if fr.fault.index == index), "?")
