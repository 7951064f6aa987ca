-- name: audit_record
-- One operator action of the console (outbox.console_audit): who, what, how many; refused: why not.
INSERT INTO outbox.console_audit (who, action, sink, target, count, refused)
VALUES (%(who)s, %(action)s, %(sink)s, %(target)s, %(count)s, %(refused)s)
RETURNING id, at;

-- name: audit_page
-- Audit records newest first (the primary key backwards), before an id for the next page.
SELECT id, at, who, role, action, sink, target, count, refused
FROM outbox.console_audit
WHERE (%(before)s::bigint IS NULL OR id < %(before)s)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: published_between
-- Events stored in a time range (index events_created_at: one range per partition); the samples' throughput.
SELECT count(*) AS published
FROM outbox.events e
WHERE e.created_at >= %(since)s AND e.created_at < %(until)s;

-- name: sample_store
-- One sink's sample of a minute; a second console sampling the same minute changes nothing.
INSERT INTO outbox.console_samples (sink, at, pending, parked, dead_letters, published)
VALUES (%(sink)s, %(at)s, %(pending)s, %(parked)s, %(dead_letters)s, %(published)s)
ON CONFLICT (sink, at) DO NOTHING
RETURNING sink;

-- name: sample_trim
-- Samples older than a day go (index console_samples_at), a bounded batch per minute.
WITH gone AS (
    DELETE FROM outbox.console_samples
    WHERE (sink, at) IN (SELECT s.sink, s.at FROM outbox.console_samples s
                         WHERE s.at < now() - interval '1 day' ORDER BY s.at LIMIT 10000)
    RETURNING 1
)
SELECT count(*) AS trimmed FROM gone;

-- name: sample_minute
-- The minute a sample is taken for (the database's clock, so that every console agrees).
SELECT date_trunc('minute', clock_timestamp()) AS minute;

-- name: samples_since
-- Every sink's samples of the last minutes (a range of index console_samples_at; the caller orders them).
SELECT s.sink, s.at, s.pending, s.parked, s.dead_letters, s.published
FROM outbox.console_samples s
WHERE s.at >= now() - make_interval(mins => %(minutes)s)  -- now(): stable, so an index bound
LIMIT %(limit)s;

-- name: waiting_keys
-- The keys of a sink that wait (a parked head), in (bucket, key) order after a position, each with its
-- head (the first entry of index parked_key per key), how many are parked, its bucket's owner and
-- lease, its dead letters and its pause.
WITH heads AS (
    -- One row per key: DISTINCT ON over index parked_key (sink, bucket, partition_key, place) in order.
    SELECT DISTINCT ON (p.bucket, p.partition_key)
           p.bucket, p.partition_key, p.event_id, p.xid, p.seq, p.attempts, p.available_at, p.last_error,
           p.parked_at
    FROM outbox.parked p
    WHERE p.sink = %(sink)s
      AND (%(after_key)s::text IS NULL OR (p.bucket, p.partition_key) > (%(after_bucket)s::int, %(after_key)s::text))
    ORDER BY p.bucket, p.partition_key, p.place
    LIMIT %(limit)s
)
SELECT h.bucket, h.partition_key, h.event_id AS head_event_id, coalesce(e.type, x.type) AS head_type,
       h.attempts AS head_attempts, h.available_at AS head_next_retry,
       round(extract(epoch FROM h.available_at - clock_timestamp())::numeric, 1) AS head_retry_in_seconds,
       h.last_error AS head_last_error, h.parked_at AS head_parked_at,
       q.parked, c.owner, c.fence,
       round(extract(epoch FROM c.lease_expires_at - clock_timestamp())::numeric, 1) AS lease_seconds_left,
       d.dead_letters, d.last_dead_at, d.last_error AS last_dead_error,
       pk.paused_at, pk.paused_by, pk.paused_role, pk.reason AS pause_reason
FROM heads h
JOIN outbox.cursors c ON c.sink = %(sink)s AND c.bucket = h.bucket
LEFT JOIN outbox.events e ON e.bucket = h.bucket AND e.xid = h.xid AND e.seq = h.seq
LEFT JOIN outbox.kept_events x ON x.bucket = h.bucket AND x.xid = h.xid AND x.seq = h.seq
CROSS JOIN LATERAL (
    -- The key's parked events: its head and those queued behind it (index parked_key).
    SELECT count(*) AS parked FROM outbox.parked p
    WHERE p.sink = %(sink)s AND p.bucket = h.bucket AND p.partition_key = h.partition_key
) q
CROSS JOIN LATERAL (
    -- Its dead letters (index dead_letters_key) and the newest one's error.
    SELECT count(*) AS dead_letters, max(y.dead_at) AS last_dead_at,
           (array_agg(y.last_error ORDER BY y.dead_at DESC))[1] AS last_error
    FROM outbox.dead_letters y
    WHERE y.sink = %(sink)s AND y.partition_key = h.partition_key
) d
LEFT JOIN outbox.paused_keys pk ON pk.sink = %(sink)s AND pk.partition_key = h.partition_key
ORDER BY h.bucket, h.partition_key;

-- name: paused_keys
-- A sink's paused keys, the oldest pause first (primary key of paused_keys, then a sort of that sink's few).
SELECT k.partition_key, k.bucket, k.paused_at, k.paused_by, k.paused_role, k.reason
FROM outbox.paused_keys k
WHERE k.sink = %(sink)s
ORDER BY k.paused_at, k.partition_key
LIMIT %(limit)s;

-- name: key_events
-- A key's newest stored events: its bucket's entries of index events_position read backwards, newest
-- partition first, then the key (there is no index by key: the producers' write path stays one index
-- lighter). A key with recent events stops after a few hundred entries; one with none reads its bucket,
-- 1/256 of what is stored. Run after ordered_scans (a bitmap of the whole bucket reads every row of it).
SELECT e.id, e.partition_key, e.bucket, e.type, e.topic, e.created_at
FROM outbox.events e
WHERE e.bucket = outbox.bucket_v1(%(key)s::text) AND e.partition_key = %(key)s
ORDER BY e.xid DESC, e.seq DESC
LIMIT %(limit)s;

-- name: ordered_scans
-- For the rest of this transaction, no bitmap scans: key_events then walks the index in order and stops
-- at its LIMIT instead of reading every row of the key's bucket.
SELECT set_config('enable_bitmapscan', 'off', true);

-- name: event_detail
-- One stored event by id (index events_id per partition; the copy kept after retention otherwise).
SELECT e.id, e.partition_key, e.bucket, e.type, e.topic, e.payload, e.headers, e.created_at, e.occurred_at,
       e.xid::text AS xid, e.seq, e.schema_version, e.idempotency_key, false AS kept
FROM outbox.events e WHERE e.id = %(event)s
UNION ALL
SELECT k.id, k.partition_key, k.bucket, k.type, k.topic, k.payload, k.headers, k.created_at, k.occurred_at,
       k.xid::text, k.seq, k.schema_version, k.idempotency_key, true
FROM outbox.kept_events k WHERE k.id = %(event)s
LIMIT 1;

-- name: event_ledger
-- Where each of these events is in every live sink: whether the sink reads its topic, whether the
-- bucket's cursor has delivered it, its parked entry (attempts, next retry, last error), its dead
-- letter, its key's pause, and the bucket's cursor (owner, fence, when it last moved).
WITH ev AS (
    -- The events (index events_id per partition), or their copies kept after retention (kept_events_id).
    SELECT e.id, e.bucket, e.xid, e.seq, e.partition_key, e.topic FROM outbox.events e WHERE e.id = ANY(%(ids)s::uuid[])
    UNION ALL
    SELECT k.id, k.bucket, k.xid, k.seq, k.partition_key, k.topic FROM outbox.kept_events k
    WHERE k.id = ANY(%(ids)s::uuid[])
)
SELECT ev.id AS event_id, s.name AS sink, s.kind,
       (s.topics IS NULL OR coalesce(ev.topic, '') = ANY(s.topics)) AS reads_topic,
       outbox.delivered_v1(ev.xid, ev.seq, c.snapshot, c.target, c.after_xid, c.after_seq) AS cursor_passed,
       c.owner, c.fence, c.advanced_at,
       p.attempts AS parked_attempts, p.available_at AS parked_next_retry, p.last_error AS parked_error,
       p.parked_at, d.attempts AS dead_attempts, d.last_error AS dead_error, d.dead_at,
       pk.paused_at, pk.paused_by
FROM ev
CROSS JOIN outbox.sinks s
JOIN outbox.cursors c ON c.sink = s.name AND c.bucket = ev.bucket
-- One probe per event and sink each (primary keys), not a join over every parked event or dead letter.
LEFT JOIN LATERAL (
    SELECT p.attempts, p.available_at, p.last_error, p.parked_at FROM outbox.parked p
    WHERE p.sink = s.name AND p.bucket = ev.bucket AND p.xid = ev.xid AND p.seq = ev.seq LIMIT 1
) p ON true
LEFT JOIN LATERAL (
    SELECT d.attempts, d.last_error, d.dead_at FROM outbox.dead_letters d
    WHERE d.sink = s.name AND d.event_id = ev.id LIMIT 1
) d ON true
LEFT JOIN LATERAL (
    SELECT pk.paused_at, pk.paused_by FROM outbox.paused_keys pk
    WHERE pk.sink = s.name AND pk.partition_key = ev.partition_key LIMIT 1
) pk ON true
WHERE s.dropped_at IS NULL AND s.name NOT LIKE '%%.rebuild'
ORDER BY ev.xid DESC, ev.seq DESC, s.name
LIMIT %(limit)s;
