-- name: try_lock
-- One housekeeper at a time across all relays: a transaction-scoped advisory lock.
SELECT pg_try_advisory_xact_lock(%(lock_key)s::bigint) AS acquired;

-- name: mark_dead_workers
-- Workers not heard from within the TTL leave the ring.
UPDATE outbox.workers
SET status = 'dead'
WHERE status <> 'dead'
  AND last_seen_at < clock_timestamp() - make_interval(secs => %(ttl)s)
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
    lapses = c.lapses + CASE WHEN outbox.bucket_has_work_v1(c.sink, c.bucket, c.position_xid, c.position_seq)
                             THEN 1 ELSE 0 END
FROM expired x
WHERE c.sink = x.sink AND c.bucket = x.bucket
RETURNING c.sink, c.bucket, x.owner;

-- name: forget_dead_workers
-- Drop registry rows of workers dead for longer than the grace period.
DELETE FROM outbox.workers
WHERE status = 'dead'
  AND last_seen_at < clock_timestamp() - make_interval(secs => %(forget_after)s);

-- name: apply_retention
-- Delete a slice of the oldest events past the retention that every sink has passed and that no
-- parked row or dead letter still needs. Every condition is a probe per row, so the scan walks
-- events_created_at oldest first and stops at the limit (a join would read all old events first).
WITH cutoff AS MATERIALIZED (
    -- Computed once: the scan below is an index range on events_created_at.
    SELECT clock_timestamp() - make_interval(secs => %(retention)s) AS t
),
old AS (
    SELECT e.ctid
    FROM outbox.events e
    WHERE e.created_at < (SELECT t FROM cutoff)
      -- Some sink has this bucket (no sink: nothing is safe to delete) ...
      AND EXISTS (SELECT 1 FROM outbox.cursors c WHERE c.bucket = e.bucket)
      -- ... and none of them is still before the event.
      AND NOT EXISTS (SELECT 1 FROM outbox.cursors c
                      WHERE c.bucket = e.bucket AND (c.position_xid, c.position_seq) < (e.xid, e.seq))
      AND NOT EXISTS (SELECT 1 FROM outbox.parked p
                      WHERE p.bucket = e.bucket AND p.xid = e.xid AND p.seq = e.seq)
      AND NOT EXISTS (SELECT 1 FROM outbox.dead_letters d
                      WHERE d.bucket = e.bucket AND d.xid = e.xid AND d.seq = e.seq)
    ORDER BY e.created_at
    LIMIT %(limit)s
)
-- By row address (a TID scan): events are never updated, so the address found above still holds.
DELETE FROM outbox.events
WHERE ctid = ANY(ARRAY(SELECT ctid FROM old));
