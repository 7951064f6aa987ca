-- name: claim
-- Take this interval's housekeeping pass, cluster-wide: only if the last pass finished an interval ago,
-- or the pass in progress went stale or belongs to a worker that stopped heartbeating. Only roles that
-- may UPDATE outbox.housekeeping can (unlike an advisory lock, which any role can hold).
UPDATE outbox.housekeeping h
SET run_by = %(worker)s, started_at = clock_timestamp()
WHERE (h.finished_at >= h.started_at
       AND h.finished_at < clock_timestamp() - make_interval(secs => %(interval)s))
   OR (h.finished_at < h.started_at
       AND (h.started_at < clock_timestamp() - make_interval(secs => %(stale)s)
            OR NOT EXISTS (SELECT 1 FROM outbox.workers w
                           WHERE w.id = h.run_by AND w.status <> 'dead'
                             -- by the TTL that worker declared (%(ttl)s: ours, for a row without one)
                             AND w.last_seen_at > clock_timestamp() - make_interval(
                                     secs => coalesce((w.metadata ->> 'ttl_seconds')::float8, %(ttl)s)))))
RETURNING h.run_by;

-- name: finish
-- The pass is over (the next one is due an interval from now).
UPDATE outbox.housekeeping SET finished_at = clock_timestamp() WHERE run_by = %(worker)s;

-- name: last_run
-- When housekeeping last finished, and who has it now: seconds since it finished, run_by, whether a
-- pass is in progress.
SELECT CASE WHEN finished_at = '-infinity' THEN 'Infinity'::float8
            ELSE extract(epoch FROM clock_timestamp() - finished_at)::float8 END,
       run_by, finished_at < started_at
FROM outbox.housekeeping;

-- name: mark_dead_workers
-- Workers not heard from within the TTL each declared (metadata ttl_seconds; ours for a row without
-- one: relays with different settings judge each other alike) are marked dead, so that expire_leases frees their leases now
-- rather than at expiry (they already left the assignments' live members: heartbeat). Only while the housekeeper's own heartbeats
-- got through: when they did not either, the database (or the way to it) was down, every worker looks
-- silent, and declaring them all dead would only move every bucket; wait until heartbeats resume.
UPDATE outbox.workers
SET status = 'dead'
WHERE status <> 'dead'
  AND id <> %(worker)s
  AND last_seen_at < clock_timestamp() - make_interval(secs => coalesce((metadata ->> 'ttl_seconds')::float8, %(ttl)s))
  AND EXISTS (SELECT 1 FROM outbox.workers me
              WHERE me.id = %(worker)s AND me.last_seen_at >= clock_timestamp() - make_interval(secs => %(ttl)s))
RETURNING id;

-- name: expire_leases
-- Free buckets whose lease ran out or whose owner is dead; the position stays, so their events
-- are read again by the next owner. A lapse with work pending is counted (crash-loop isolation).
WITH expired AS (
    -- Locked here so that RETURNING can name the owner the lease is taken from.
    SELECT c.sink, c.bucket, c.owner
    FROM outbox.cursors c
    WHERE c.owner IS NOT NULL
      AND (c.lease_expires_at < clock_timestamp()
           OR c.owner IN (SELECT id FROM outbox.workers WHERE status = 'dead'))
    FOR UPDATE
)
UPDATE outbox.cursors c
SET owner = NULL, lease_expires_at = NULL,
    lapses = c.lapses + CASE WHEN outbox.bucket_has_work_v3(c.sink, c.bucket, c.snapshot, c.target,
                                                            c.after_xid, c.after_seq)
                             THEN 1 ELSE 0 END
FROM expired x
WHERE c.sink = x.sink AND c.bucket = x.bucket
RETURNING c.sink, c.bucket, x.owner;

-- name: terminate_stalled
-- Connections of relays whose leases were just taken back, still inside a transaction: a stalled relay
-- (stopped, partitioned) whose row locks would otherwise outlive its lease and block the bucket's next
-- owner (a pipelined projection batch is never synced, so idle_in_transaction_session_timeout does not
-- end it). Every transaction of an owner declared dead (it can not checkpoint any more: fenced); of a
-- live owner, only one older than the lease (it may be busy with another sink). A dead owner's idle
-- connections go too: its LISTEN connection may hold the lock of the relay that watches for commits
-- (wakeups.py), which another relay takes over once it is free. Relays name their connections
-- 'outbox-relay <worker id>'.
WITH owners AS (
    SELECT o.app, coalesce(w.status = 'dead', false) AS dead  -- no row: unknown, judged like a live one
    FROM unnest(%(owners)s::text[], %(application_names)s::text[]) AS o(id, app)
    LEFT JOIN outbox.workers w ON w.id = o.id
)
SELECT a.pid, a.application_name, pg_terminate_backend(a.pid)
FROM pg_stat_activity a
JOIN owners o ON o.app = a.application_name
WHERE a.datname = current_database()
  AND (o.dead OR a.xact_start < clock_timestamp() - make_interval(secs => %(lease_seconds)s))
  AND a.pid <> pg_backend_pid();

-- name: forget_dead_workers
-- Drop registry rows of workers dead for longer than the grace period.
DELETE FROM outbox.workers
WHERE status = 'dead'
  AND last_seen_at < clock_timestamp() - make_interval(secs => %(forget_after)s);
