"""Projections of the acceptance tests, loaded by the real ``outbox-relay`` processes by module name.

Both read the producers' ``acceptance.counted`` events (payload ``{"key", "n"}``, n counting 1, 2,
3... per key) and log what they apply, with the applying process's pid, so the tests can check
exactly-once and per-key order from the tables alone.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from projections import ProjectionEvent, Registry

registry = Registry()

SCHEMA = """
CREATE TABLE ledger (id bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL, n int NOT NULL,
                     pid int NOT NULL, replay boolean NOT NULL);
CREATE TABLE counts (key text PRIMARY KEY, applied int NOT NULL, last_n int NOT NULL);
CREATE TABLE flaky_ledger (id bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL, n int NOT NULL);
CREATE TABLE switches (name text PRIMARY KEY);
CREATE TABLE blocking_ledger (id bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL, n int NOT NULL);
CREATE TABLE batched_ledger (id bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL, n int NOT NULL,
                             pid int NOT NULL);
"""


@registry.projection("ledger", events=["acceptance.counted"], tables=["ledger", "counts"])
def ledger(event: ProjectionEvent[Any], tx: Any) -> None:
    p = event.payload
    if p.get("pause"):  # the test stops this process here, inside the batch's transaction
        pause_dir = os.environ.get("OUTBOX_TEST_PAUSE_DIR")
        if pause_dir and not event.replay:
            Path(pause_dir, f"{os.getpid()}-{event.id}").touch()
            time.sleep(float(p["pause"]))
    delay = os.environ.get("OUTBOX_TEST_REPLAY_DELAY")
    if delay and event.replay:  # a rebuild slow enough to interrupt; it marks that it is replaying
        pause_dir = os.environ.get("OUTBOX_TEST_PAUSE_DIR")
        if pause_dir:
            Path(pause_dir, f"{os.getpid()}-replaying").touch()
        time.sleep(float(delay))
    tx.execute("INSERT INTO ledger (event_id, key, n, pid, replay) VALUES (%s, %s, %s, %s, %s)",
               (event.id, event.key, p["n"], os.getpid(), event.replay))
    tx.execute("INSERT INTO counts VALUES (%s, 1, %s) ON CONFLICT (key) DO UPDATE "
               "SET applied = counts.applied + 1, last_n = EXCLUDED.last_n", (event.key, p["n"]))


@ledger.key_reset
def _reset_ledger(key: str, tx: Any) -> None:
    tx.execute("DELETE FROM ledger WHERE key = %s", (key,))
    tx.execute("DELETE FROM counts WHERE key = %s", (key,))


@registry.projection("flaky", events=["acceptance.counted"], tables=["flaky_ledger"])
def flaky(event: ProjectionEvent[Any], tx: Any) -> None:
    if tx.execute("SELECT 1 FROM switches WHERE name = 'flaky_ok'").fetchone() is None:
        raise RuntimeError("flaky projection: downstream not ready")
    tx.execute("INSERT INTO flaky_ledger (event_id, key, n) VALUES (%s, %s, %s)",
               (event.id, event.key, event.payload["n"]))


@registry.projection("blocking", events=["acceptance.counted"], tables=["blocking_ledger"])
def blocking(event: ProjectionEvent[Any], tx: Any) -> None:
    """Never returns for an event whose payload says ``block`` (a socket without a timeout, a deadlock in
    a library); marks that it entered in OUTBOX_TEST_PAUSE_DIR."""
    if event.payload.get("block"):
        pause_dir = os.environ.get("OUTBOX_TEST_PAUSE_DIR")
        if pause_dir:
            Path(pause_dir, f"{os.getpid()}-{event.id}-{event.attempt}").touch()
        threading.Event().wait()
    tx.execute("INSERT INTO blocking_ledger (event_id, key, n) VALUES (%s, %s, %s)",
               (event.id, event.key, event.payload["n"]))


@registry.projection("ledger_batched", events=["acceptance.counted"], tables=["batched_ledger"], batch=True)
def ledger_batched(events: list[ProjectionEvent[Any]], tx: Any) -> None:
    """Set-based: one INSERT per call. An event whose payload says ``pause`` splits the call: the
    events before it are written, then the handler sleeps (marking OUTBOX_TEST_PAUSE_DIR), so a
    test can kill the process with half the batch written in its transaction. Only the first
    process to get there pauses (the one that takes over applies the batch at once)."""
    def write(part: list[ProjectionEvent[Any]]) -> None:
        if part:
            tx.execute("INSERT INTO batched_ledger (event_id, key, n, pid) "
                       "SELECT * FROM unnest(%s::uuid[], %s::text[], %s::int[], %s::int[])",
                       ([e.id for e in part], [e.key for e in part], [e.payload["n"] for e in part],
                        [os.getpid()] * len(part)))

    pause_dir = os.environ.get("OUTBOX_TEST_PAUSE_DIR")
    for i, event in enumerate(events):
        if event.payload.get("pause") and pause_dir and not event.replay and not any(Path(pause_dir).iterdir()):
            write(events[:i])
            Path(pause_dir, f"{os.getpid()}-{event.id}").touch()
            time.sleep(float(event.payload["pause"]))
            write(events[i:])
            return
    write(events)
