-- name: workers
-- The registry with each worker's leased buckets per sink, and whether its LISTEN connection is up
-- (false: it only polls, so new events wait up to --poll-seconds; NULL: it runs with --no-listen).
-- Host and pid of the process that holds the id, the TTL it is judged by, and a second relay refused
-- under the same id (clash).
SELECT w.id, w.status, w.sinks,
       round(extract(epoch FROM clock_timestamp() - w.last_seen_at)::numeric, 1) AS seen_seconds_ago,
       (w.metadata ->> 'ttl_seconds')::float8 AS ttl_seconds,
       w.metadata ->> 'host' AS host, (w.metadata ->> 'pid')::int AS pid,
       (w.metadata ->> 'listening')::boolean AS listening,
       CASE WHEN w.metadata ? 'clash'
            THEN format('refused a second relay on host %%s (pid %%s) at %%s', w.metadata -> 'clash' ->> 'host',
                        w.metadata -> 'clash' ->> 'pid',
                        to_char((w.metadata -> 'clash' ->> 'at')::timestamptz, 'YYYY-MM-DD HH24:MI:SSOF'))
       END AS clash,
       coalesce((SELECT jsonb_object_agg(sink, n) FROM (
           SELECT c.sink, count(*) AS n FROM outbox.cursors c WHERE c.owner = w.id GROUP BY c.sink) s), '{}') AS buckets
FROM outbox.workers w
ORDER BY w.id;

-- name: backlog
-- Per sink (every live one, or only sink): events not yet delivered, the age of the oldest, parked
-- (retrying), held by paused keys, and dead letters.
SELECT s.name AS sink, s.kind,
       coalesce(sum(b.pending), 0)::bigint AS pending,
       round(extract(epoch FROM clock_timestamp() - min(b.oldest))::numeric, 1) AS oldest_pending_seconds,
       -- Parked events split by whether their key is paused (outbox-relay keys pause): those of a
       -- paused key wait for an operator, not for a retry.
       (SELECT count(*) FROM outbox.parked p
        WHERE p.sink = s.name
          AND NOT EXISTS (SELECT 1 FROM outbox.paused_keys k
                          WHERE k.sink = p.sink AND k.partition_key = p.partition_key)) AS parked,
       (SELECT count(*) FROM outbox.parked p
        JOIN outbox.paused_keys k ON k.sink = p.sink AND k.partition_key = p.partition_key
        WHERE p.sink = s.name) AS paused,
       (SELECT count(*) FROM outbox.paused_keys k WHERE k.sink = s.name) AS paused_keys,
       (SELECT count(*) FROM outbox.dead_letters d WHERE d.sink = s.name) AS dead_letters,
       count(c.owner) AS leased_buckets,
       count(*) FILTER (WHERE c.owner IS NOT NULL AND c.lease_expires_at < clock_timestamp()) AS expired_leases
FROM outbox.sinks s
JOIN outbox.cursors c ON c.sink = s.name AND (%(sink)s::text IS NULL OR s.name = %(sink)s)
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

-- name: history
-- Per projection: the topics it reads, from when their events are stored (how far back a rebuild goes: the oldest event of the partitions that may hold them), what retention removed of partitions that held them, and whether a full rebuild would hold everything the projection applied (else it needs --accept-partial; missing: what went since its history began).
SELECT s.name AS projection, s.topics,
       outbox.history_stored_from_v1(s.topics) AS stored_from,
       r.removed_through, coalesce(r.removed_events, 0) AS removed_events,
       r.missing IS NULL AS full_rebuild_complete, r.missing
FROM outbox.sinks s
CROSS JOIN LATERAL (
    -- What retention removed of partitions that held its topics (0015: per class and topics), and of
    -- that, what went after its history began.
    SELECT max(h.removed_through) AS removed_through, sum(h.removed_events)::bigint AS removed_events,
           string_agg(CASE WHEN h.removed_at > s.history_since
                           THEN h.class || ' through ' || to_char(h.removed_through AT TIME ZONE 'UTC',
                                                                  'YYYY-MM-DD"T"HH24:MI:SS"Z"') END,
                      ', ' ORDER BY h.class) AS missing
    FROM outbox.history_removed h
    WHERE outbox.history_covers_v1(h.topics, h.except_topics, s.topics)
) r
WHERE s.kind = 'projection' AND s.dropped_at IS NULL AND s.name NOT LIKE '%%.rebuild'
ORDER BY s.name;

-- name: horizon_holder
-- The oldest open writing transaction, a session's or a prepared one, in this database (or on the
-- whole server with all_databases; for `status`, the name is from before migration 0007). It delays
-- only its own events now (snapshot cursors), but it holds back vacuum, and the backlog counts read
-- each bucket from its id on. No query text: it may show other roles' data (and secrets in literals).
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
WHERE %(all_databases)s OR database = current_database()
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
-- Dead letters with their event, newest first (ties by sink and event id, so that pages are stable);
-- with after, those after that page's last row (its dead_at, sink, event id as of the previous page).
SELECT d.sink, d.event_id, d.partition_key, coalesce(e.type, k.type) AS type, coalesce(e.topic, k.topic) AS topic,
       d.attempts, d.last_error, d.dead_at
FROM outbox.dead_letters d
LEFT JOIN outbox.events e ON e.bucket = d.bucket AND e.xid = d.xid AND e.seq = d.seq
-- 0015: the copy kept once retention dropped the event's partition.
LEFT JOIN outbox.kept_events k ON k.bucket = d.bucket AND k.xid = d.xid AND k.seq = d.seq
WHERE (%(sink)s::text IS NULL OR d.sink = %(sink)s)
  AND (%(key)s::text IS NULL OR d.partition_key = %(key)s)
  AND (%(after_dead_at)s::timestamptz IS NULL
       OR (d.dead_at, d.sink, d.event_id) < (%(after_dead_at)s, %(after_sink)s::text, %(after_event)s::uuid))
ORDER BY d.dead_at DESC, d.sink DESC, d.event_id DESC
LIMIT %(limit)s;

-- name: dead_letter_position
-- Where the dead letter of an event stands in the listing's order (for `dead-letters list --after`).
SELECT d.dead_at, d.sink, d.event_id
FROM outbox.dead_letters d
WHERE d.event_id = %(event)s AND (%(sink)s::text IS NULL OR d.sink = %(sink)s)
ORDER BY d.dead_at DESC, d.sink DESC
LIMIT 1;

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
ORDER BY bucket, partition_key, xid, seq  -- a key's retried dead letters queue in position order
ON CONFLICT DO NOTHING
RETURNING event_id, bucket;

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
  AND w.last_seen_at > clock_timestamp()
                       - make_interval(secs => coalesce((w.metadata ->> 'ttl_seconds')::float8, %(ttl)s))
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
-- Tombstone a sink: its cursors, parked events, dead letters, paused keys and a rebuild row naming it go; the
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
paused AS (
    -- A sink recreated later starts afresh, with no key held.
    DELETE FROM outbox.paused_keys WHERE sink = %(sink)s
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

-- name: share_sink
-- A sink's kind and tombstone, locked against a concurrent `sinks drop` (which deletes the sink's
-- pauses and parked events) until this transaction ends; relays registering or parking are not held up.
SELECT kind, dropped_at FROM outbox.sinks WHERE name = %(sink)s FOR SHARE;

-- name: key_state
-- One partition key per sink (all live sinks, or one): its bucket's owner and lease, its parked head
-- and how many events are parked, its committed events the sink's cursor has not passed, its dead
-- letters, its pause, and whether any event of it is stored at all (else the key is unknown: never
-- published, misspelt, or removed by retention).
WITH k AS (
    -- The key and its bucket (the function that fills outbox.events.bucket).
    SELECT %(key)s::text AS key, outbox.bucket_v1(%(key)s::text) AS bucket
)
SELECT s.name AS sink, s.kind, k.bucket, c.owner, c.fence, c.lease_expires_at,
       round(extract(epoch FROM c.lease_expires_at - clock_timestamp())::numeric, 1) AS lease_seconds_left,
       h.event_id AS head_event_id, h.type AS head_type, h.attempts AS head_attempts,
       h.available_at AS head_next_retry,
       round(extract(epoch FROM h.available_at - clock_timestamp())::numeric, 1) AS head_retry_in_seconds,
       h.last_error AS head_last_error, h.parked_at AS head_parked_at,
       q.parked, u.unread, u.oldest_unread, d.dead_letters, d.last_dead_at, st.stored,
       pk.paused_at, pk.paused_by, pk.paused_role, pk.reason AS pause_reason
FROM outbox.sinks s
CROSS JOIN k
JOIN outbox.cursors c ON c.sink = s.name AND c.bucket = k.bucket
LEFT JOIN LATERAL (
    -- The head: the key's first parked event in chain order (the first entry of index parked_key), and its type.
    SELECT p.event_id, coalesce(e.type, x.type) AS type, p.attempts, p.available_at, p.last_error, p.parked_at
    FROM outbox.parked p
    LEFT JOIN outbox.events e ON e.bucket = p.bucket AND e.xid = p.xid AND e.seq = p.seq
    LEFT JOIN outbox.kept_events x ON x.bucket = p.bucket AND x.xid = p.xid AND x.seq = p.seq  -- partition gone (0015)
    WHERE p.sink = s.name AND p.bucket = k.bucket AND p.partition_key = k.key
    ORDER BY p.place
    LIMIT 1
) h ON true
CROSS JOIN LATERAL (
    -- Every parked event of the key: the head and the events queued behind it.
    SELECT count(*) AS parked
    FROM outbox.parked p
    WHERE p.sink = s.name AND p.bucket = k.bucket AND p.partition_key = k.key
) q
CROSS JOIN LATERAL (
    -- Committed events of the key the cursor has not delivered (the bucket's index range from the
    -- oldest transaction the cursor has not seen, then the key).
    SELECT count(*) AS unread, min(e.created_at) AS oldest_unread
    FROM outbox.events e
    WHERE e.bucket = k.bucket AND e.xid >= pg_snapshot_xmin(c.snapshot) AND e.partition_key = k.key
      AND NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq)
) u
CROSS JOIN LATERAL (
    -- Dead letters of the key (index dead_letters_key).
    SELECT count(*) AS dead_letters, max(x.dead_at) AS last_dead_at
    FROM outbox.dead_letters x
    WHERE x.sink = s.name AND x.partition_key = k.key
) d
CROSS JOIN LATERAL (
    -- Whether the key has a stored event (the bucket's index range, then the key; stops at the first).
    SELECT count(*) AS stored
    FROM (SELECT 1 FROM outbox.events e WHERE e.bucket = k.bucket AND e.partition_key = k.key LIMIT 1) one
) st
LEFT JOIN outbox.paused_keys pk ON pk.sink = s.name AND pk.partition_key = k.key
WHERE s.dropped_at IS NULL AND (%(sink)s::text IS NULL OR s.name = %(sink)s)
ORDER BY s.name;

-- name: lock_key_head
-- A key's parked head for one sink, locked: a relay rescheduling or finishing it waits until we
-- commit. Also how many events of the key are parked in all.
SELECT p.event_id, p.bucket, p.xid::text AS xid, p.seq, p.attempts, p.last_error, p.available_at,
       coalesce(e.type, x.type) AS type,
       (SELECT count(*) FROM outbox.parked q
        WHERE q.sink = p.sink AND q.bucket = p.bucket AND q.partition_key = p.partition_key) AS parked
FROM outbox.parked p
LEFT JOIN outbox.events e ON e.bucket = p.bucket AND e.xid = p.xid AND e.seq = p.seq
LEFT JOIN outbox.kept_events x ON x.bucket = p.bucket AND x.xid = p.xid AND x.seq = p.seq  -- partition gone (0015)
WHERE p.sink = %(sink)s AND p.bucket = outbox.bucket_v1(%(key)s::text) AND p.partition_key = %(key)s
ORDER BY p.place
LIMIT 1
FOR UPDATE OF p;

-- name: retry_key_head
-- The locked head (lock_key_head) due now; the events behind it follow it as usual.
UPDATE outbox.parked
SET available_at = clock_timestamp()
WHERE sink = %(sink)s AND bucket = %(bucket)s AND xid = %(xid)s::xid8 AND seq = %(seq)s
RETURNING event_id;

-- name: fence_key_bucket
-- Before keys skip takes a head out of the park: a new fence for the key's bucket, so that an attempt
-- of the head in flight lands nothing (its checkpoint is fenced out; the owner acquires the bucket
-- again). The cursor row is locked before the park's rows, in the order the relay's checkpoint takes them.
UPDATE outbox.cursors SET fence = fence + 1, fenced_by = 'keys skip'
WHERE sink = %(sink)s AND bucket = outbox.bucket_v1(%(key)s::text)
RETURNING fence;

-- name: skip_key_head
-- The locked head (lock_key_head) to dead letters with the operator's reason; the key's events queued
-- behind it become due, so the key moves on.
WITH head AS (
    DELETE FROM outbox.parked p
    WHERE p.sink = %(sink)s AND p.bucket = %(bucket)s AND p.xid = %(xid)s::xid8 AND p.seq = %(seq)s
    RETURNING p.*
),
dead AS (
    -- As the relay records a dead letter (checkpoint in relay.sql).
    INSERT INTO outbox.dead_letters (sink, event_id, bucket, xid, seq, partition_key, attempts, last_error)
    SELECT h.sink, h.event_id, h.bucket, h.xid, h.seq, h.partition_key, h.attempts, %(error)s FROM head h
    ON CONFLICT (sink, event_id) DO UPDATE
        SET attempts = EXCLUDED.attempts, last_error = EXCLUDED.last_error, dead_at = clock_timestamp()
    RETURNING event_id
),
behind AS (
    -- The rest of the key's queue: every other parked event of the key lies behind the head.
    UPDATE outbox.parked q
    SET available_at = least(q.available_at, clock_timestamp())
    FROM head h
    WHERE q.sink = h.sink AND q.bucket = h.bucket AND q.partition_key = h.partition_key
      AND q.place > h.place
    RETURNING q.event_id
)
SELECT (SELECT count(*) FROM dead) AS dead_lettered, (SELECT count(*) FROM behind) AS behind;

-- name: paused_key
-- A key's pause for one sink (no row: not paused).
SELECT paused_at, paused_by, paused_role, reason
FROM outbox.paused_keys
WHERE sink = %(sink)s AND partition_key = %(key)s;

-- name: pause_key
-- Hold a key for one sink (nothing if it is held already): from its next read on the relay parks the
-- key's events and retries none of them.
INSERT INTO outbox.paused_keys (sink, partition_key, paused_by, reason)
VALUES (%(sink)s, %(key)s, %(by)s, %(reason)s)
ON CONFLICT (sink, partition_key) DO NOTHING
RETURNING paused_at;

-- name: resume_key
-- Let a paused key go: its parked events become due at once (a failed head's remaining backoff too).
WITH resumed AS (
    DELETE FROM outbox.paused_keys
    WHERE sink = %(sink)s AND partition_key = %(key)s
    RETURNING sink, partition_key, bucket, paused_at
),
due AS (
    UPDATE outbox.parked p
    SET available_at = clock_timestamp()
    FROM resumed r
    WHERE p.sink = r.sink AND p.bucket = r.bucket AND p.partition_key = r.partition_key
    RETURNING p.event_id
)
SELECT r.bucket, r.paused_at, (SELECT count(*) FROM due) AS due FROM resumed r;

-- name: notify_parked
-- Tell the relay that holds a bucket that a parked key there changed (relay.PARKED_NOTICE), so that
-- it looks at its park now rather than at its next retry time; sent when the transaction commits.
SELECT pg_notify('outbox_events_v2', 'parked:' || %(bucket)s::int);
