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
    -- Committed events this bucket's cursor has not delivered (an index range from the oldest
    -- transaction it has not seen) and the oldest of them.
    SELECT count(*) AS pending, min(e.created_at) AS oldest
    FROM outbox.events e
    WHERE e.bucket = c.bucket AND e.xid >= pg_snapshot_xmin(c.snapshot)
      AND NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq)
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

-- name: sinks
-- Every sink, dropped ones (tombstones) too, with its backlog.
SELECT s.name AS sink, s.kind, s.created_at, s.dropped_at,
       (SELECT coalesce(sum(b.pending), 0)::bigint
        FROM outbox.cursors c
        CROSS JOIN LATERAL (
            -- Committed events this bucket's cursor has not delivered (an index range count).
            SELECT count(*) AS pending
            FROM outbox.events e
            WHERE e.bucket = c.bucket AND e.xid >= pg_snapshot_xmin(c.snapshot)
              AND NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq)
        ) b
        WHERE c.sink = s.name) AS pending,
       (SELECT count(*) FROM outbox.cursors c WHERE c.sink = s.name AND c.owner IS NOT NULL) AS leased_buckets
FROM outbox.sinks s
ORDER BY s.dropped_at IS NOT NULL, s.name;

-- name: sink
-- One sink's kind and tombstone.
SELECT kind, dropped_at FROM outbox.sinks WHERE name = %(sink)s;

-- name: lock_sink
-- A sink's row, locked for a drop or recreate: a relay registering it (whose cursor inserts check
-- this row as their foreign key) waits until we commit.
SELECT kind, dropped_at FROM outbox.sinks WHERE name = %(sink)s FOR UPDATE;

-- name: lock_sink_cursors
-- A sink's cursors, locked: no lease on them can be taken or renewed until the drop commits, so
-- the lease check that follows is final.
SELECT bucket FROM outbox.cursors WHERE sink = %(sink)s ORDER BY bucket FOR UPDATE;

-- name: sink_workers
-- Relays that run a sink: alive or draining, and heard from within the TTL.
SELECT w.id, w.status, round(extract(epoch FROM clock_timestamp() - w.last_seen_at)::numeric, 1) AS seen_seconds_ago
FROM outbox.workers w
WHERE %(sink)s = ANY(w.sinks)
  AND w.status <> 'dead'
  AND w.last_seen_at > clock_timestamp() - make_interval(secs => %(ttl)s)
ORDER BY w.id;

-- name: sink_leases
-- Unexpired leases on a sink's buckets, per owner.
SELECT c.owner, count(*) AS buckets
FROM outbox.cursors c
WHERE c.sink = %(sink)s AND c.owner IS NOT NULL AND c.lease_expires_at > clock_timestamp()
GROUP BY c.owner
ORDER BY c.owner;

-- name: sink_rebuild
-- A rebuild of this projection in progress (it would switch over into the sink).
SELECT r.sink, r.started_at FROM outbox.rebuilds r WHERE r.projection = %(sink)s AND r.sink <> %(sink)s;

-- name: sink_losses
-- What dropping a sink forgets: events past its cursors (never delivered to it), its parked events
-- (retrying) and its dead letters.
SELECT (SELECT coalesce(sum(b.pending), 0)::bigint
        FROM outbox.cursors c
        CROSS JOIN LATERAL (
            -- Committed events this bucket's cursor has not delivered (an index range count).
            SELECT count(*) AS pending
            FROM outbox.events e
            WHERE e.bucket = c.bucket AND e.xid >= pg_snapshot_xmin(c.snapshot)
              AND NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq)
        ) b
        WHERE c.sink = %(sink)s) AS pending,
       (SELECT count(*) FROM outbox.parked p WHERE p.sink = %(sink)s) AS parked,
       (SELECT count(*) FROM outbox.dead_letters d WHERE d.sink = %(sink)s) AS dead_letters;

-- name: drop_sink
-- Tombstone a sink: its cursors, parked events, dead letters and a rebuild row naming it go; the
-- row stays with dropped_at set, so a relay still running the sink stops instead of registering
-- it again from the oldest retained event (which would apply that history a second time).
WITH cursors AS (
    -- Without cursors, retention no longer waits for this sink.
    DELETE FROM outbox.cursors WHERE sink = %(sink)s RETURNING bucket
),
parked AS (
    DELETE FROM outbox.parked WHERE sink = %(sink)s RETURNING event_id
),
dead AS (
    DELETE FROM outbox.dead_letters WHERE sink = %(sink)s RETURNING event_id
),
rebuild AS (
    -- A rebuild whose own sink this is can not go on.
    DELETE FROM outbox.rebuilds WHERE sink = %(sink)s RETURNING projection, shadow_schema
)
UPDATE outbox.sinks s
SET dropped_at = clock_timestamp()
WHERE s.name = %(sink)s AND s.dropped_at IS NULL
RETURNING s.dropped_at,
          (SELECT count(*) FROM parked) AS parked,
          (SELECT count(*) FROM dead) AS dead_letters,
          (SELECT projection FROM rebuild) AS rebuild_of,
          (SELECT shadow_schema FROM rebuild) AS shadow_schema;

-- name: recreate_sink
-- Clear a sink's tombstone: the next relay that runs it registers it anew (new cursors at position
-- zero: from the oldest retained event).
UPDATE outbox.sinks SET dropped_at = NULL WHERE name = %(sink)s AND dropped_at IS NOT NULL RETURNING kind;
