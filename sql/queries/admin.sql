-- name: workers
-- The registry with each worker's leased buckets per sink.
SELECT w.id, w.status, w.sinks,
       round(extract(epoch FROM clock_timestamp() - w.last_seen_at)::numeric, 1) AS seen_seconds_ago,
       coalesce((SELECT jsonb_object_agg(sink, n) FROM (
           SELECT c.sink, count(*) AS n FROM outbox.cursors c WHERE c.owner = w.id GROUP BY c.sink) s), '{}') AS buckets
FROM outbox.workers w
ORDER BY w.id;

-- name: backlog
-- Per sink: events not yet delivered, the age of the oldest, parked (retrying) and dead letters.
SELECT s.name AS sink, s.kind,
       coalesce(sum(b.pending), 0)::bigint AS pending,
       round(extract(epoch FROM clock_timestamp() - min(b.oldest))::numeric, 1) AS oldest_pending_seconds,
       (SELECT count(*) FROM outbox.parked p WHERE p.sink = s.name) AS parked,
       (SELECT count(*) FROM outbox.dead_letters d WHERE d.sink = s.name) AS dead_letters,
       count(c.owner) AS leased_buckets,
       count(*) FILTER (WHERE c.owner IS NOT NULL AND c.lease_expires_at < clock_timestamp()) AS expired_leases
FROM outbox.sinks s
JOIN outbox.cursors c ON c.sink = s.name
CROSS JOIN LATERAL (
    -- Events past this bucket's cursor (an index range count) and the oldest of them.
    SELECT count(*) AS pending, min(e.created_at) AS oldest
    FROM outbox.events e
    WHERE e.bucket = c.bucket AND (e.xid, e.seq) > (c.position_xid, c.position_seq)
) b
GROUP BY s.name, s.kind
ORDER BY s.name;

-- name: horizon_holder
-- The oldest open writing transaction, a session's or a prepared one: relays read nothing newer
-- until it ends. No query text: it may show other roles' data (and secrets in literals).
WITH holders AS (
    -- Sessions whose transaction has written (only those have a transaction id).
    SELECT pid, usename::text AS role, datname::text AS database, application_name AS application, state,
           xact_start AS since, backend_xid AS xid, false AS prepared, NULL::text AS gid
    FROM pg_stat_activity
    WHERE backend_xid IS NOT NULL
    UNION ALL
    -- Prepared (two-phase) transactions: no session left, held until COMMIT/ROLLBACK PREPARED.
    SELECT NULL, owner::text, database::text, NULL, 'prepared', prepared, transaction, true, gid
    FROM pg_prepared_xacts
)
SELECT pid, role, application, state,
       round(extract(epoch FROM clock_timestamp() - since)::numeric, 1) AS open_seconds, prepared, gid, database
FROM holders
ORDER BY age(xid) DESC
LIMIT 1;

-- name: dead_letters_by_key
-- Dead letters grouped by partition key (the part 8 support query).
SELECT sink, partition_key, count(*) AS dead_letters, max(last_error) AS sample_error, max(dead_at) AS last_dead_at
FROM outbox.dead_letters
WHERE (%(sink)s::text IS NULL OR sink = %(sink)s)
GROUP BY sink, partition_key
ORDER BY dead_letters DESC, partition_key
LIMIT %(limit)s;

-- name: dead_letters
-- Dead letters with their event, newest first.
SELECT d.sink, d.event_id, d.partition_key, e.type, e.topic, d.attempts, d.last_error, d.dead_at
FROM outbox.dead_letters d
LEFT JOIN outbox.events e ON e.bucket = d.bucket AND e.xid = d.xid AND e.seq = d.seq
WHERE (%(sink)s::text IS NULL OR d.sink = %(sink)s)
  AND (%(key)s::text IS NULL OR d.partition_key = %(key)s)
ORDER BY d.dead_at DESC
LIMIT %(limit)s;

-- name: retry_dead_letters
-- Move dead letters back to the park, due now; the bucket's owner delivers them again.
WITH moved AS (
    DELETE FROM outbox.dead_letters d
    WHERE d.sink = %(sink)s
      AND (%(event_ids)s::uuid[] IS NULL OR d.event_id = ANY(%(event_ids)s::uuid[]))
      AND (%(key)s::text IS NULL OR d.partition_key = %(key)s)
    RETURNING d.*
)
INSERT INTO outbox.parked (sink, bucket, xid, seq, partition_key, event_id, attempts, available_at, last_error)
SELECT sink, bucket, xid, seq, partition_key, event_id, 0, clock_timestamp(), last_error FROM moved
ON CONFLICT DO NOTHING
RETURNING event_id;

-- name: discard_dead_letters
-- Forget dead letters for good (the events themselves age out with retention).
DELETE FROM outbox.dead_letters d
WHERE d.sink = %(sink)s
  AND (%(event_ids)s::uuid[] IS NULL OR d.event_id = ANY(%(event_ids)s::uuid[]))
  AND (%(key)s::text IS NULL OR d.partition_key = %(key)s)
RETURNING d.event_id;

-- name: rebuilds
-- Projection rebuilds in progress (they hold retention back while they run).
SELECT projection, sink, started_at, total_events, options
FROM outbox.rebuilds
ORDER BY projection;

-- name: drop_sink
-- Forget a retired sink: its cursors, parked events and dead letters (else it holds retention back).
DELETE FROM outbox.sinks WHERE name = %(sink)s RETURNING kind;
