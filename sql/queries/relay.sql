-- name: register_sink
-- Create a sink (its cursors follow in a statement of their own, so that row security policies that
-- look the sink up see it). Its history begins at the current retention watermark: it starts from
-- the oldest event still stored, so nothing removed before is missing from it.
INSERT INTO outbox.sinks (name, kind, history_from)
VALUES (%(sink)s, %(kind)s, (SELECT removed_through FROM outbox.history))
ON CONFLICT (name) DO NOTHING;

-- name: set_sink_topics
-- The topics a sink reads (NULL: all), written when they changed: `status` and rebuilds tell which
-- retention classes' history it needs (0015).
UPDATE outbox.sinks SET topics = %(topics)s::text[]
WHERE name = %(sink)s AND kind = %(kind)s AND dropped_at IS NULL AND topics IS DISTINCT FROM %(topics)s::text[];

-- name: register_cursors
-- A sink's cursor rows (position zero: a new sink starts from the oldest retained event). A dropped
-- sink (tombstone) gets none back: the caller refuses it.
INSERT INTO outbox.cursors (sink, bucket)
SELECT %(sink)s, b FROM generate_series(0, 255) AS b
WHERE EXISTS (SELECT 1 FROM outbox.sinks s WHERE s.name = %(sink)s AND s.kind = %(kind)s AND s.dropped_at IS NULL)
ON CONFLICT (sink, bucket) DO NOTHING;

-- name: lock_sink_state
-- The kind and tombstone of a sink being registered, waiting for a `sinks drop` in progress (it locks
-- the row) so that its tombstone is seen, not missed.
SELECT kind, dropped_at FROM outbox.sinks WHERE name = %(sink)s FOR KEY SHARE;

-- name: sink_kind
-- The kind a sink was registered with (one name is never used for two kinds), and when it was dropped.
SELECT kind, dropped_at FROM outbox.sinks WHERE name = %(sink)s;

-- name: range_starts
-- Where each xid range partition of outbox.events begins (NULL: the DEFAULT one), from the catalog, which
-- every role that reads events may read (store.read_floor).
SELECT substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \(''(\d+)''\)')
FROM pg_catalog.pg_inherits i
JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'outbox.events'::regclass;

-- name: fetch_events
-- Read each leased bucket's delta (positions.py): events of transactions visible in the bucket's target
-- snapshot (the current one unless a delta is being read in pages) and not in the snapshot its cursor
-- has seen, in (xid, seq) order, after the last one delivered, up to a per-bucket limit. Fenced like a
-- checkpoint: only buckets still leased under the caller's fence, which the last row lists (the fence
-- check of the caller's previous Kafka batch rides on this read: relay.py ``SinkRunner._pending``).
WITH now AS (
    SELECT pg_current_snapshot() AS snapshot
),
wanted AS MATERIALIZED (
    -- The buckets to read, in the caller's (rotating) order, each with its limit and read cursor (the
    -- caller's: it may be ahead of the stored one), if the caller still holds the bucket's lease: its
    -- owner, under the fence it names (NULL: any), not expired. Materialized: evaluated once, so the
    -- buckets read are exactly the buckets the last row says were held.
    SELECT w.bucket, w.lim, w.seen::pg_snapshot AS seen, coalesce(w.target::pg_snapshot, n.snapshot) AS target,
           -- Where each half of the delta starts, as a (xid, seq) bound the index scans can start from:
           -- after the last event delivered, if it lies in that half.
           coalesce(w.after_xid::xid8, '0'::xid8) AS open_xid, coalesce(w.after_seq, -1) AS open_seq,
           CASE WHEN w.after_xid::xid8 >= pg_snapshot_xmax(w.seen::pg_snapshot) THEN w.after_xid::xid8
                ELSE pg_snapshot_xmax(w.seen::pg_snapshot) END AS later_xid,
           CASE WHEN w.after_xid::xid8 >= pg_snapshot_xmax(w.seen::pg_snapshot) THEN w.after_seq
                ELSE -1 END AS later_seq,
           -- Transactions open in the cursor's snapshot that are visible in the target: committed since.
           ARRAY(SELECT x FROM pg_snapshot_xip(w.seen::pg_snapshot) AS x
                 WHERE pg_visible_in_snapshot(x, coalesce(w.target::pg_snapshot, n.snapshot))) AS committed_since
    FROM unnest(%(buckets)s::int[], %(limits)s::int[], %(seen)s::text[], %(targets)s::text[],
                %(after_xids)s::text[], %(after_seqs)s::bigint[], %(fences)s::bigint[])
         AS w(bucket, lim, seen, target, after_xid, after_seq, fence)
    JOIN outbox.cursors c ON c.sink = %(sink)s AND c.bucket = w.bucket AND c.owner = %(worker)s
                         AND c.fence = coalesce(w.fence, c.fence) AND c.lease_expires_at > clock_timestamp()
    CROSS JOIN now n
),
blocked AS (
    -- Keys with parked events, and keys an operator paused for this sink (outbox-relay keys pause):
    -- newer events of these keys queue behind them, in the park.
    SELECT p.partition_key
    FROM outbox.parked p
    WHERE p.sink = %(sink)s AND p.bucket = ANY(%(buckets)s::int[])
    UNION
    SELECT k.partition_key
    FROM outbox.paused_keys k
    WHERE k.sink = %(sink)s AND k.bucket = ANY(%(buckets)s::int[])
)
SELECT e.bucket, e.xid::text::bigint AS xid, e.seq, e.id, e.partition_key, e.topic, e.type,
       e.payload::text AS payload, e.headers::text AS headers, coalesce(e.occurred_at, e.created_at) AS time,
       e.partition_key IN (SELECT partition_key FROM blocked) AS blocked,
       -- Ready-made header values for the Kafka sink (formatting in SQL costs less than in Python);
       -- NULL for a sink that sends no headers (a projection): a rebuild reads every stored event.
       CASE WHEN %(formatted)s THEN e.id::text END AS id_text,
       CASE WHEN %(formatted)s THEN to_char(coalesce(e.occurred_at, e.created_at) AT TIME ZONE 'UTC',
                                            'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') END AS time_text,
       CASE WHEN %(formatted)s THEN lpad(e.xid::text, 20, '0') || '-' || lpad(e.seq::text, 20, '0') END
           AS sequence_text,
       (SELECT snapshot::text FROM now) AS now, e.created_at AS stored_at, e.schema_version AS version,
       NULL::int[] AS held, NULL::timestamptz AS checked_at
FROM wanted w
CROSS JOIN LATERAL (
    SELECT d.*
    FROM (
        -- Transactions still open when the cursor's snapshot was taken that have committed since
        -- (one index probe per such transaction id). Their ids are below the snapshot's xmax, so
        -- they come first.
        -- With none, the scan is skipped (a one-time filter): an empty ANY would still walk the bucket
        -- from the cursor on, the whole of it in a rebuild from the start of history.
        (SELECT e.*
         FROM outbox.events e
         WHERE cardinality(w.committed_since) > 0
           AND e.bucket = w.bucket
           AND e.xid = ANY(w.committed_since)
           -- Implied by the line above; written out so that only the partitions of the snapshot's
           -- [xmin, xmax) are probed (0014: outbox.events is partitioned by xid ranges).
           AND e.xid >= pg_snapshot_xmin(w.seen) AND e.xid < pg_snapshot_xmax(w.seen)
           -- The start of the xid range that holds the lowest xmin of all the cursors' snapshots, a
           -- constant (store.fetch_sql): the planner prunes the partitions below it (the bounds above
           -- are known only at run time; a plan over every partition locks every partition).
           AND e.xid >= {floor}::xid8
           AND (e.xid, e.seq) > (w.open_xid, w.open_seq)
           AND (%(types)s::text[] IS NULL OR e.type = ANY(%(types)s::text[]))
           AND (%(topics)s::text[] IS NULL OR e.topic = ANY(%(topics)s::text[]))
         ORDER BY e.xid, e.seq
         LIMIT w.lim)
        UNION ALL
        -- Transactions that started after it: one index range scan on events_position.
        (SELECT e.*
         FROM outbox.events e
         WHERE e.bucket = w.bucket
           AND (e.xid, e.seq) > (w.later_xid, w.later_seq) AND e.xid < pg_snapshot_xmax(w.target)
           -- Implied by the row comparison; the partitions before it are not probed (0014).
           AND e.xid >= w.later_xid AND e.xid >= {floor}::xid8
           AND pg_visible_in_snapshot(e.xid, w.target)
           -- A sink that wants some event types or topics only (a projection) is not sent the rest;
           -- its cursor still moves past them.
           AND (%(types)s::text[] IS NULL OR e.type = ANY(%(types)s::text[]))
           AND (%(topics)s::text[] IS NULL OR e.topic = ANY(%(topics)s::text[]))
         ORDER BY e.xid, e.seq
         LIMIT w.lim)
    ) d
    ORDER BY d.xid, d.seq
    LIMIT w.lim
) e
UNION ALL
-- One row carrying the current snapshot even when no bucket has anything to read, the buckets that were
-- held (read), and when (the database's clock: a batch whose check rode on this read landed then).
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       (SELECT snapshot::text FROM now), NULL, NULL, ARRAY(SELECT bucket FROM wanted), clock_timestamp();

-- name: fetch_parked
-- Parked chains that are due: per key, the head (whose retry time has come) and the events queued behind it;
-- none of a paused key; only of buckets the caller still holds under the fences it names.
WITH held AS (
    -- Fenced as fetch_events: a relay that lost a bucket (a new owner or fence, or its lease ran out)
    -- retries nothing more of it. A caller that names no worker (an operator's read) gets every bucket.
    SELECT w.bucket
    FROM unnest(%(buckets)s::int[], %(fences)s::bigint[]) AS w(bucket, fence)
    WHERE %(worker)s::text IS NULL
       OR EXISTS (SELECT 1 FROM outbox.cursors c
                  WHERE c.sink = %(sink)s AND c.bucket = w.bucket AND c.owner = %(worker)s
                    AND c.fence = w.fence AND c.lease_expires_at > clock_timestamp())
),
heads AS (
    -- The first parked event of each key (chain order: the order they were parked in, 0009) decides
    -- when the key may move again.
    SELECT DISTINCT ON (p.bucket, p.partition_key) p.bucket, p.partition_key, p.available_at
    FROM outbox.parked p
    WHERE p.sink = %(sink)s AND p.bucket = ANY(ARRAY(SELECT bucket FROM held))
    ORDER BY p.bucket, p.partition_key, p.place
),
due AS (
    -- Heads whose retry time has come, of keys that are not paused (those wait for keys resume).
    SELECT h.bucket, h.partition_key FROM heads h
    WHERE h.available_at <= clock_timestamp()
      AND NOT EXISTS (SELECT 1 FROM outbox.paused_keys k WHERE k.sink = %(sink)s AND k.partition_key = h.partition_key)
    LIMIT %(keys)s
)
SELECT q.bucket, q.xid::text::bigint AS xid, q.seq, e.id, e.partition_key, e.topic, e.type,
       e.payload::text AS payload, e.headers::text AS headers, coalesce(e.occurred_at, e.created_at) AS time,
       -- Ready-made header values for the Kafka sink (formatting in SQL costs less than in Python).
       e.id::text AS id_text,
       to_char(coalesce(e.occurred_at, e.created_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS time_text,
       lpad(q.xid::text, 20, '0') || '-' || lpad(q.seq::text, 20, '0') AS sequence_text,
       q.attempts, q.last_error, e.created_at AS stored_at, e.schema_version AS version
FROM due d
CROSS JOIN LATERAL (
    SELECT * FROM outbox.parked q
    WHERE q.sink = %(sink)s AND q.bucket = d.bucket AND q.partition_key = d.partition_key
    ORDER BY q.place
    LIMIT %(per_key)s
) q
LEFT JOIN LATERAL (
    -- The event: in its partition, or (0015) its copy once retention dropped the partition. None: it lies
    -- below the floor (parked after the floor was looked up): store.fetch_parked reads again.
    (SELECT e.id, e.partition_key, e.topic, e.type, e.payload, e.headers, e.occurred_at, e.created_at,
            e.schema_version
     FROM outbox.events e WHERE e.bucket = q.bucket AND e.xid = q.xid AND e.seq = q.seq
                            -- The start of the range holding the oldest parked event, a constant
                            -- (store.parked_sql, looked up every 30 s): the planner prunes the xid
                            -- ranges below it.
                            AND e.xid >= {floor}::xid8)
    UNION ALL
    (SELECT k.id, k.partition_key, k.topic, k.type, k.payload, k.headers, k.occurred_at, k.created_at,
            k.schema_version
     FROM outbox.kept_events k WHERE k.bucket = q.bucket AND k.xid = q.xid AND k.seq = q.seq)
    LIMIT 1
) e ON true
ORDER BY q.bucket, q.partition_key, q.place;

-- name: oldest_parked
-- The transaction id of the oldest event parked in these buckets (NULL: none): the floor of fetch_parked.
SELECT min(xid)::text FROM outbox.parked WHERE sink = %(sink)s AND bucket = ANY(%(buckets)s::int[]);

-- name: server_started
-- When the server of this connection started. After a crash restart PostgreSQL hands out again the
-- transaction ids whose WAL had not reached disk, so a snapshot taken before it may count new
-- transactions as seen: read cursors held only in memory are dropped (runner/checkpoints.py,
-- ``CheckpointWriter.same_server``).
SELECT pg_postmaster_start_time();

-- name: next_parked_retry
-- Seconds until the next parked retry of these buckets is due (NULL: nothing parked): the runner sleeps
-- until then instead of polling the park. Only a key's head has a retry time (the events queued behind
-- it, parked due at once, wait for it: counting them had an idle runner poll the park every few
-- milliseconds while a head waited for its retry), and a paused key's events are not retried.
SELECT extract(epoch FROM min(h.available_at) - clock_timestamp())::float8
FROM (
    -- The head of each key (index parked_key), as in fetch_parked.
    SELECT DISTINCT ON (p.bucket, p.partition_key) p.partition_key, p.available_at
    FROM outbox.parked p
    WHERE p.sink = %(sink)s AND p.bucket = ANY(%(buckets)s::int[])
    ORDER BY p.bucket, p.partition_key, p.place
) h
WHERE NOT EXISTS (SELECT 1 FROM outbox.paused_keys k WHERE k.sink = %(sink)s AND k.partition_key = h.partition_key);

-- name: has_parked
-- Whether any event of a bucket is parked (due or not) that a retry will come for (not a paused key's).
SELECT EXISTS (SELECT 1 FROM outbox.parked p
               WHERE p.sink = %(sink)s AND p.bucket = %(bucket)s
                 AND NOT EXISTS (SELECT 1 FROM outbox.paused_keys k
                                 WHERE k.sink = p.sink AND k.partition_key = p.partition_key));

-- name: advance
-- Commit one batch's outcome that only moves cursors (nothing to park, unpark or dead-letter: most
-- batches), fenced as in checkpoint below, whose first step this is; the caller learns which buckets
-- made it. A statement of its own: the whole checkpoint opens the park and the dead letters every time.
-- A bucket whose cursor write the caller defers (``writes`` false: a sink without a transaction of its
-- own, its cursor written recently) gets the same fence check as a read: a write per batch would leave a
-- dead row version per batch while a long transaction holds vacuum back.
WITH v AS (
    -- One row per bucket of the batch.
    SELECT *
    FROM unnest(%(buckets)s::int[], %(fences)s::bigint[], %(seen)s::text[], %(targets)s::text[],
                %(after_xids)s::text[], %(after_seqs)s::bigint[], %(resets)s::boolean[], %(writes)s::boolean[])
         AS v(bucket, fence, seen, target, after_xid, after_seq, reset, write)
),
moved AS (
    -- The buckets written now: the fence check and the cursor advance in one step.
    UPDATE outbox.cursors c
    SET snapshot    = coalesce(v.seen::pg_snapshot, c.snapshot),
        target      = CASE WHEN v.seen IS NULL THEN c.target ELSE v.target::pg_snapshot END,
        after_xid   = CASE WHEN v.seen IS NULL THEN c.after_xid ELSE v.after_xid::xid8 END,
        after_seq   = CASE WHEN v.seen IS NULL THEN c.after_seq ELSE v.after_seq END,
        lapses      = CASE WHEN v.reset THEN 0 ELSE c.lapses END,
        advanced_at = clock_timestamp(),
        -- The row is written anyway: the lease is renewed with it, so that renew_leases need not write it.
        lease_expires_at = greatest(c.lease_expires_at,
                                    clock_timestamp() + make_interval(secs => %(lease_seconds)s::float8))
    FROM v
    WHERE v.write AND c.sink = %(sink)s AND c.bucket = v.bucket
      AND c.owner = %(worker)s AND c.fence = v.fence
      AND c.lease_expires_at > clock_timestamp()
    RETURNING c.bucket
)
SELECT bucket, clock_timestamp() FROM moved
UNION ALL
-- The deferred ones: only the fence check (no row version).
SELECT c.bucket, clock_timestamp()
FROM v
JOIN outbox.cursors c ON c.sink = %(sink)s AND c.bucket = v.bucket
WHERE NOT v.write AND c.owner = %(worker)s AND c.fence = v.fence
  AND c.lease_expires_at > clock_timestamp();

-- name: checkpoint
-- Commit one batch's outcome, fenced: for the buckets still leased under the same token, advance
-- cursors, park or reschedule failures, drop finished parked rows and record dead letters.
-- Buckets whose lease was lost get nothing; the caller learns which buckets made it.
WITH v AS (
    -- One row per bucket of the batch.
    SELECT *
    FROM unnest(%(buckets)s::int[], %(fences)s::bigint[], %(seen)s::text[], %(targets)s::text[],
                %(after_xids)s::text[], %(after_seqs)s::bigint[], %(resets)s::boolean[], %(writes)s::boolean[])
         AS v(bucket, fence, seen, target, after_xid, after_seq, reset, write)
),
fenced AS (
    -- The fence check and the cursor advance in one step (a NULL seen: the bucket's cursor stays).
    UPDATE outbox.cursors c
    SET snapshot    = coalesce(v.seen::pg_snapshot, c.snapshot),
        target      = CASE WHEN v.seen IS NULL THEN c.target ELSE v.target::pg_snapshot END,
        after_xid   = CASE WHEN v.seen IS NULL THEN c.after_xid ELSE v.after_xid::xid8 END,
        after_seq   = CASE WHEN v.seen IS NULL THEN c.after_seq ELSE v.after_seq END,
        lapses      = CASE WHEN v.reset THEN 0 ELSE c.lapses END,
        advanced_at = clock_timestamp(),
        -- The row is written anyway: the lease is renewed with it, so that renew_leases need not write it.
        lease_expires_at = greatest(c.lease_expires_at,
                                    clock_timestamp() + make_interval(secs => %(lease_seconds)s::float8))
    FROM v
    WHERE v.write AND c.sink = %(sink)s AND c.bucket = v.bucket
      AND c.owner = %(worker)s AND c.fence = v.fence
      AND c.lease_expires_at > clock_timestamp()
    RETURNING c.bucket
),
parking AS (
    -- Events to park or reschedule; ``parked``: read from the park (its row should still be there).
    SELECT p.*
    FROM unnest(%(park_buckets)s::int[], %(park_xids)s::bigint[], %(park_seqs)s::bigint[],
                %(park_keys)s::text[], %(park_ids)s::uuid[], %(park_attempts)s::int[],
                %(park_delays)s::float8[], %(park_errors)s::text[], %(park_parked)s::boolean[])
         WITH ORDINALITY AS p(bucket, xid, seq, partition_key, event_id, attempts, delay, error, parked, ord)
    WHERE p.bucket IN (SELECT bucket FROM fenced)
),
park AS (
    -- New parked events, numbered (place) in the order the batch delivered them: a key's chain order.
    INSERT INTO outbox.parked (sink, bucket, xid, seq, partition_key, event_id, attempts, available_at, last_error)
    SELECT %(sink)s, p.bucket, p.xid::text::xid8, p.seq, p.partition_key, p.event_id, p.attempts,
           clock_timestamp() + make_interval(secs => p.delay), p.error
    FROM parking p
    WHERE NOT p.parked
    ORDER BY p.ord
    ON CONFLICT (sink, bucket, xid, seq) DO UPDATE
        SET attempts = EXCLUDED.attempts, available_at = EXCLUDED.available_at, last_error = EXCLUDED.last_error
),
repark AS (
    -- New retry times for parked heads that failed again: an update, never an insert, so that a
    -- head an operator took out of the park while it was being retried (keys skip) stays out.
    UPDATE outbox.parked q
    SET attempts = p.attempts, available_at = clock_timestamp() + make_interval(secs => p.delay), last_error = p.error
    FROM parking p
    WHERE p.parked AND q.sink = %(sink)s AND q.bucket = p.bucket AND q.xid = p.xid::text::xid8 AND q.seq = p.seq
),
unpark AS (
    -- Parked events that were delivered or dead-lettered.
    DELETE FROM outbox.parked q
    USING unnest(%(done_buckets)s::int[], %(done_xids)s::bigint[], %(done_seqs)s::bigint[]) AS d(bucket, xid, seq)
    WHERE q.sink = %(sink)s AND q.bucket = d.bucket AND q.xid = d.xid::text::xid8 AND q.seq = d.seq
      AND d.bucket IN (SELECT bucket FROM fenced)
),
dead AS (
    -- Poison events: past max attempts or failed for good; they stop blocking their key.
    INSERT INTO outbox.dead_letters (sink, event_id, bucket, xid, seq, partition_key, attempts, last_error)
    SELECT %(sink)s, x.event_id, x.bucket, x.xid::text::xid8, x.seq, x.partition_key, x.attempts, x.error
    FROM unnest(%(dead_buckets)s::int[], %(dead_xids)s::bigint[], %(dead_seqs)s::bigint[],
                %(dead_keys)s::text[], %(dead_ids)s::uuid[], %(dead_attempts)s::int[], %(dead_errors)s::text[])
         AS x(bucket, xid, seq, partition_key, event_id, attempts, error)
    WHERE x.bucket IN (SELECT bucket FROM fenced)
    ON CONFLICT (sink, event_id) DO UPDATE
        SET attempts = EXCLUDED.attempts, last_error = EXCLUDED.last_error, dead_at = clock_timestamp()
)
SELECT bucket, clock_timestamp() FROM fenced;
