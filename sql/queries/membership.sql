-- name: heartbeat
-- Register this worker or refresh it.
INSERT INTO outbox.workers (id, status, sinks, metadata)
VALUES (%(worker)s, %(status)s, %(sinks)s::text[], %(metadata)s::jsonb)
ON CONFLICT (id) DO UPDATE
    SET status = EXCLUDED.status, sinks = EXCLUDED.sinks, metadata = EXCLUDED.metadata,
        last_seen_at = clock_timestamp();

-- name: heartbeat_existing
-- Refresh a registered worker only (draining): a heartbeat that arrives after the worker left must not
-- bring its row back.
UPDATE outbox.workers
SET status = %(status)s, sinks = %(sinks)s::text[], metadata = %(metadata)s::jsonb, last_seen_at = clock_timestamp()
WHERE id = %(worker)s;

-- name: live_workers
-- Workers that count for ring ownership: alive (not draining) and heard from within the TTL.
SELECT id, sinks
FROM outbox.workers
WHERE status = 'alive'
  AND last_seen_at > clock_timestamp() - make_interval(secs => %(ttl)s)
ORDER BY id;

-- name: leave
-- Clean exit: the worker is gone from the registry at once.
DELETE FROM outbox.workers WHERE id = %(worker)s;

-- name: acquire_leases
-- Lease free or expired buckets of one sink, or take up again, under a new fence, one still in
-- this worker's name (its fence was bumped, or it restarted with the same id). Each acquisition
-- bumps the fence; taking over an expired lease (or another worker's) of a bucket that had work
-- counts a lapse (crash-loop isolation).
UPDATE outbox.cursors c
SET owner            = %(worker)s,
    fence            = c.fence + 1,
    lapses           = c.lapses + CASE WHEN c.owner IS NOT NULL
                                        AND (c.owner <> %(worker)s OR c.lease_expires_at < clock_timestamp())
                                        AND outbox.bucket_has_work_v2(c.sink, c.bucket, c.snapshot, c.target,
                                                                      c.after_xid, c.after_seq)
                                       THEN 1 ELSE 0 END,
    lease_expires_at = clock_timestamp() + make_interval(secs => %(lease_seconds)s)
WHERE c.sink = %(sink)s
  AND c.bucket = ANY(%(buckets)s::int[])
  AND (c.owner IS NULL OR c.owner = %(worker)s OR c.lease_expires_at < clock_timestamp())
RETURNING c.bucket, c.fence, c.lapses, c.snapshot::text, c.target::text, c.after_xid::text, c.after_seq;

-- name: renew_leases
-- Extend the leases this worker still holds under the same fence; missing buckets were lost.
UPDATE outbox.cursors c
SET lease_expires_at = clock_timestamp() + make_interval(secs => %(lease_seconds)s)
FROM unnest(%(buckets)s::int[], %(fences)s::bigint[]) AS v(bucket, fence)
WHERE c.sink = %(sink)s AND c.bucket = v.bucket
  AND c.owner = %(worker)s AND c.fence = v.fence
  AND c.lease_expires_at > clock_timestamp()
RETURNING c.bucket;

-- name: release_leases
-- Hand buckets back without waiting for expiry (ring change, drain).
UPDATE outbox.cursors c
SET owner = NULL, lease_expires_at = NULL
FROM unnest(%(buckets)s::int[], %(fences)s::bigint[]) AS v(bucket, fence)
WHERE c.sink = %(sink)s AND c.bucket = v.bucket
  AND c.owner = %(worker)s AND c.fence = v.fence
RETURNING c.bucket;

-- name: announce_buckets
-- Tell the relays that want these buckets (their next owners) that they are free now: the same
-- channel and payload as a commit's notification, so they try at once instead of at their next poll.
SELECT pg_notify('outbox_events_v2', %(buckets)s);
