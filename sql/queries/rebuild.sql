-- Queries of `outbox-relay rebuild` (projections/rebuild.py). Blocks with {braces} are
-- templates whose identifiers are filled in with psycopg.sql.Identifier, never by string
-- formatting.

-- name: lock_projection
-- One rebuild starts, switches or cancels at a time per projection (transaction-scoped).
SELECT pg_advisory_xact_lock(hashtextextended('outbox-relay rebuild ' || %(projection)s, 0));

-- name: get
-- The rebuild of a projection in progress, if any.
SELECT projection, sink, shadow_schema, live_tables, options, total_events, started_at
FROM outbox.rebuilds
WHERE projection = %(projection)s;

-- name: insert
-- Remember a rebuild as it starts.
INSERT INTO outbox.rebuilds (projection, sink, shadow_schema, live_tables, options)
VALUES (%(projection)s, %(sink)s, %(shadow_schema)s, %(live_tables)s::text[], %(options)s::jsonb);

-- name: set_total
-- The number of events the rebuild replays, counted once at its start.
UPDATE outbox.rebuilds SET total_events = %(total)s WHERE projection = %(projection)s;

-- name: drop_sink
-- Forget a sink with its cursors, parked events, dead letters and rebuild row (cascades).
DELETE FROM outbox.sinks WHERE name = %(sink)s;

-- name: table_info
-- A declared table, resolved on the search path: oid, schema, name, owner, kind.
SELECT c.oid, n.nspname, c.relname, pg_get_userbyid(c.relowner), c.relkind
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass(%(name)s);

-- name: table_oid
-- A table's oid by schema and name (no search path, no quoting): the oids of a rebuild's copies,
-- to tell later whether they were switched in.
SELECT c.oid
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relname = %(name)s;

-- name: history_bounds
-- Where a rebuild may start: the next transaction id, the first and the last stored (committed) event
-- in position order, and when the newest event was stored.
WITH firsts AS (
    -- Each bucket's first event (one index probe on events_position per bucket).
    SELECT f.xid, f.seq
    FROM generate_series(0, 255) AS b(bucket)
    CROSS JOIN LATERAL (
        SELECT e.xid, e.seq FROM outbox.events e
        WHERE e.bucket = b.bucket
        ORDER BY e.xid, e.seq LIMIT 1
    ) f
),
lasts AS (
    -- Each bucket's last event (one backward probe per bucket).
    SELECT l.xid, l.seq
    FROM generate_series(0, 255) AS b(bucket)
    CROSS JOIN LATERAL (
        SELECT e.xid, e.seq FROM outbox.events e
        WHERE e.bucket = b.bucket
        ORDER BY e.xid DESC, e.seq DESC LIMIT 1
    ) l
)
SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS next_xid,
       (SELECT ARRAY[xid::text::bigint, seq] FROM firsts ORDER BY xid, seq LIMIT 1) AS first,
       (SELECT ARRAY[xid::text::bigint, seq] FROM lasts ORDER BY xid DESC, seq DESC LIMIT 1) AS last,
       (SELECT max(created_at) FROM outbox.events) AS newest,
       clock_timestamp() AS now;

-- name: wait_for_retention
-- A rebuild's history check comes after this read of every leaf of outbox.events (ACCESS SHARE, taken as it
-- is planned): it waits for a removal that holds a leaf (ACCESS EXCLUSIVE, 0020) to commit, so the check
-- sees what it removed. Reads no row.
SELECT NULL FROM outbox.events LIMIT 0;

-- name: table_blockers
-- What a table swap can not carry over: views, incoming foreign keys, triggers, policies.
SELECT 'view ' || v.oid::regclass::text
FROM pg_depend d
JOIN pg_rewrite r ON r.oid = d.objid
JOIN pg_class v ON v.oid = r.ev_class
WHERE d.classid = 'pg_rewrite'::regclass AND d.refobjid = %(oid)s AND v.oid <> %(oid)s
UNION
SELECT 'foreign key ' || conname || ' of ' || conrelid::regclass::text
FROM pg_constraint WHERE confrelid = %(oid)s AND contype = 'f'
UNION
SELECT 'trigger ' || tgname FROM pg_trigger WHERE tgrelid = %(oid)s AND NOT tgisinternal
UNION
SELECT 'row security policy ' || polname FROM pg_policy WHERE polrelid = %(oid)s;

-- name: foreign_keys
-- Outgoing foreign keys of a table: CREATE TABLE ... LIKE does not copy them.
SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %(oid)s AND contype = 'f';

-- name: serial_columns
-- Columns whose default draws from a sequence the table owns (serial): the copy needs its own.
SELECT a.attname, s.relname
FROM pg_attribute a
JOIN pg_depend d ON d.refobjid = a.attrelid AND d.refobjsubid = a.attnum AND d.deptype = 'a'
                AND d.classid = 'pg_class'::regclass
JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S'
WHERE a.attrelid = %(oid)s AND a.attnum > 0 AND NOT a.attisdropped AND a.attidentity = '';

-- name: table_grants
-- Privileges granted on a table (grantee 0 is PUBLIC), to grant them again on its copy.
SELECT CASE WHEN g.grantee = 0 THEN NULL ELSE pg_get_userbyid(g.grantee) END, g.privilege_type, g.is_grantable
FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) g
WHERE c.oid = %(oid)s AND g.grantee <> c.relowner;

-- name: create_schema
CREATE SCHEMA {schema};

-- name: drop_schema
DROP SCHEMA IF EXISTS {schema} CASCADE;

-- name: create_copy
-- Same columns, defaults, identity, checks, indexes, storage and comments.
CREATE TABLE {copy} (LIKE {live} INCLUDING ALL);

-- name: add_constraint
ALTER TABLE {table} ADD CONSTRAINT {name} {definition};

-- name: own_sequence
CREATE SEQUENCE {sequence} OWNED BY {table}.{column};

-- name: default_from_sequence
ALTER TABLE {table} ALTER COLUMN {column} SET DEFAULT nextval({sequence_name});

-- name: grant
GRANT {privilege} ON {table} TO {grantee};

-- name: grant_with_option
GRANT {privilege} ON {table} TO {grantee} WITH GRANT OPTION;

-- name: set_owner
ALTER TABLE {table} OWNER TO {owner};

-- name: lock_table
-- Readers wait for the swap (short); live projection writers finish or wait.
LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE;

-- name: move_table
ALTER TABLE {table} SET SCHEMA {schema};

-- name: start_at_position
-- A rebuild from a position: every bucket's cursor just before it (positions.Cursor.at).
UPDATE outbox.cursors
SET snapshot = %(seen)s::pg_snapshot, target = %(target)s::pg_snapshot, after_xid = %(after_xid)s::xid8,
    after_seq = %(after_seq)s
WHERE sink = %(sink)s;

-- name: start_at_time
-- A rebuild from a time: per bucket, just before its first event at or after that time, or
-- past its last event when it has none.
UPDATE outbox.cursors c
SET snapshot  = CASE WHEN p.xid IS NULL THEN '1:1:'
                     ELSE (p.xid::text || ':' || p.xid::text || ':') END::pg_snapshot,
    target    = CASE WHEN p.xid IS NULL THEN NULL
                     ELSE ((p.xid::text::bigint + 1)::text || ':' || (p.xid::text::bigint + 1)::text || ':')::pg_snapshot
                END,
    after_xid = p.xid,
    after_seq = p.seq
FROM generate_series(0, 255) AS b(bucket)
LEFT JOIN LATERAL (
    -- The bucket's first event at or after the time, in position order.
    SELECT e.xid, e.seq FROM outbox.events e
    WHERE e.bucket = b.bucket AND e.created_at >= %(time)s
    ORDER BY e.xid, e.seq LIMIT 1
) f ON true
LEFT JOIN LATERAL (
    -- Its last event, when none is that recent.
    SELECT e.xid, e.seq FROM outbox.events e
    WHERE e.bucket = b.bucket
    ORDER BY e.xid DESC, e.seq DESC LIMIT 1
) l ON true
-- The cursor is just before f, or just after l (positions.Cursor.at).
CROSS JOIN LATERAL (SELECT coalesce(f.xid, l.xid) AS xid, coalesce(f.seq - 1, l.seq) AS seq) p
WHERE c.sink = %(sink)s AND c.bucket = b.bucket;

-- name: remaining
-- Committed events a sink has still to deliver, counting only those it wants.
SELECT coalesce(sum(x.n), 0)::bigint
FROM outbox.cursors c
CROSS JOIN LATERAL (
    SELECT count(*) AS n
    FROM outbox.events e
    WHERE e.bucket = c.bucket
      AND e.xid >= pg_snapshot_xmin(c.snapshot)
      AND NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq)
      AND (%(types)s::text[] IS NULL OR e.type = ANY(%(types)s::text[]))
      AND (%(topics)s::text[] IS NULL OR e.topic = ANY(%(topics)s::text[]))
) x
WHERE c.sink = %(sink)s;

-- name: cursors
-- A sink's distinct cursors and the buckets at each, up to a limit (one while every bucket's is the same: a
-- rebuild from the start or a position; one per lane after the bulk phase's lanes, bulk.py).
SELECT c.snapshot::text AS seen, c.target::text AS target, c.after_xid::text AS after_xid, c.after_seq,
       array_agg(c.bucket ORDER BY c.bucket) AS buckets
FROM outbox.cursors c
WHERE c.sink = %(sink)s
GROUP BY c.snapshot::text, c.target::text, c.after_xid, c.after_seq
LIMIT %(limit)s;

-- name: remaining_from
-- ``remaining`` of the buckets (NULL: all) whose cursor is this one: one scan of the events, not one per
-- bucket (whose bitmap scans, with a type or topic filter, visited every heap page once per bucket: 9 s for
-- 1M events).
SELECT count(*)
FROM outbox.events e
WHERE e.xid >= pg_snapshot_xmin(%(seen)s::pg_snapshot)
  AND NOT outbox.delivered_v1(e.xid, e.seq, %(seen)s::pg_snapshot, %(target)s::pg_snapshot, %(after_xid)s::xid8,
                              %(after_seq)s::bigint)
  AND (%(buckets)s::int[] IS NULL OR e.bucket = ANY(%(buckets)s::int[]))
  AND (%(types)s::text[] IS NULL OR e.type = ANY(%(types)s::text[]))
  AND (%(topics)s::text[] IS NULL OR e.topic = ANY(%(topics)s::text[]));

-- name: lock_cursors
-- The switch: no relay may checkpoint either sink until it commits.
SELECT sink, bucket FROM outbox.cursors
WHERE sink IN (%(live)s, %(rebuild)s)
ORDER BY sink, bucket
FOR UPDATE;

-- name: adopt_cursors
-- The live projection continues from where the rebuild got to. The fence bump fences out the
-- batches relays have in flight on its buckets (they roll back); the owners keep their
-- leases and take the buckets up again under a new fence at once. The new fence is above the
-- rebuild's too, so that the live projection's fence tokens outrank every token the rebuild gave
-- (a store outside the transaction that the rebuild wrote keeps taking live writes).
UPDATE outbox.cursors l
SET snapshot = r.snapshot, target = r.target, after_xid = r.after_xid, after_seq = r.after_seq,
    fence = greatest(l.fence, r.fence) + 1, lapses = 0, advanced_at = clock_timestamp(),
    fenced_by = 'a rebuild''s switch-over'
FROM outbox.cursors r
WHERE l.sink = %(live)s AND r.sink = %(rebuild)s AND r.bucket = l.bucket;

-- name: keep_live_decisions
-- The switch, before the rebuild's park and dead letters take the live name: what live processing decided
-- stays decided (G12). Returns what it drops, to be reported: ('dead' | 'parked', event, key, error).
WITH both_dead AS (
    -- Dead in both (the replay follows live dead letters, decisions.py): the live row stays as it is, with
    -- its reason, attempts and time, so an operator's skip stays a skip.
    DELETE FROM outbox.dead_letters r USING outbox.dead_letters l
    WHERE r.sink = %(rebuild)s AND l.sink = %(live)s AND l.event_id = r.event_id
),
skipped_meanwhile AS (
    -- Parked by the rebuild, dead-lettered live since (a skip while the switch waited): dead stays dead.
    DELETE FROM outbox.parked r USING outbox.dead_letters l
    WHERE r.sink = %(rebuild)s AND l.sink = %(live)s AND l.event_id = r.event_id
),
carried AS (
    -- Parked in both: held by the replay (decisions.HELD), the live row's attempts, error and next retry
    -- carry on; failing in both, the retries go on from the live attempts, not from scratch. The rebuild's
    -- rows keep their order (its own park, of its own cursors).
    UPDATE outbox.parked r
    SET attempts = greatest(r.attempts, l.attempts),
        last_error = CASE WHEN r.last_error = %(held)s THEN l.last_error ELSE coalesce(r.last_error, l.last_error) END,
        available_at = CASE WHEN r.last_error = %(held)s THEN l.available_at ELSE r.available_at END
    FROM outbox.parked l
    WHERE r.sink = %(rebuild)s AND l.sink = %(live)s AND (l.bucket, l.xid, l.seq) = (r.bucket, r.xid, r.seq)
      AND NOT EXISTS (SELECT 1 FROM outbox.dead_letters d WHERE d.sink = %(live)s AND d.event_id = r.event_id)
),
unheld AS (
    -- Held for a pause that live processing has not read the events of yet: they wait in the park as the
    -- pause's (queued), under the live name from now on.
    UPDATE outbox.parked r SET last_error = NULL
    WHERE r.sink = %(rebuild)s AND r.last_error = %(held)s
      AND NOT EXISTS (SELECT 1 FROM outbox.parked l
                      WHERE l.sink = %(live)s AND (l.bucket, l.xid, l.seq) = (r.bucket, r.xid, r.seq))
),
moot_dead AS (
    -- Dead-lettered live after the rebuild had applied the event: the new model holds its effect, so the
    -- dead letter would be false (reported).
    DELETE FROM outbox.dead_letters l
    WHERE l.sink = %(live)s
      AND NOT EXISTS (SELECT 1 FROM outbox.dead_letters r WHERE r.sink = %(rebuild)s AND r.event_id = l.event_id)
      AND NOT EXISTS (SELECT 1 FROM outbox.parked r WHERE r.sink = %(rebuild)s AND r.event_id = l.event_id)
    RETURNING l.event_id, l.partition_key, l.last_error
),
live_parked AS (
    -- The live retries: the rebuild's park replaces them (its cursors passed every event they hold:
    -- behind_live). Those it applied are reported.
    DELETE FROM outbox.parked l WHERE l.sink = %(live)s
    RETURNING l.event_id, l.partition_key, l.last_error
)
SELECT 'dead' AS kind, d.event_id, d.partition_key, d.last_error FROM moot_dead d
UNION ALL
SELECT 'parked', p.event_id, p.partition_key, p.last_error FROM live_parked p
WHERE NOT EXISTS (SELECT 1 FROM outbox.parked r WHERE r.sink = %(rebuild)s AND r.event_id = p.event_id)
  AND NOT EXISTS (SELECT 1 FROM outbox.dead_letters r WHERE r.sink = %(rebuild)s AND r.event_id = p.event_id)
ORDER BY 3, 2;

-- name: follow_live
-- The rebuild's parked events whose live decision changed since: dead-lettered live (keys skip while the
-- rebuild ran), or held for live processing (decisions.HELD) that live no longer holds (it applied them,
-- or their key was resumed). Due now, so that the replay's retry follows (dead-letters or applies them) before the switch.
WITH due AS (
    UPDATE outbox.parked p SET available_at = clock_timestamp()
    WHERE p.sink = %(rebuild)s
      AND (EXISTS (SELECT 1 FROM outbox.dead_letters d WHERE d.sink = %(live)s AND d.event_id = p.event_id)
           OR (p.last_error = %(held)s
               AND NOT EXISTS (SELECT 1 FROM outbox.parked l
                               WHERE l.sink = %(live)s AND (l.bucket, l.xid, l.seq) = (p.bucket, p.xid, p.seq))
               -- still paused live and not read there yet: live will hold it too
               AND NOT EXISTS (SELECT 1 FROM outbox.paused_keys k
                               JOIN outbox.cursors c ON c.sink = k.sink AND c.bucket = k.bucket
                               WHERE k.sink = %(live)s AND k.partition_key = p.partition_key
                                 AND NOT outbox.delivered_v1(p.xid, p.seq, c.snapshot, c.target, c.after_xid,
                                                             c.after_seq))))
    RETURNING p.bucket
)
SELECT b.bucket, pg_notify('outbox_events_v2', 'parked:' || b.bucket)
FROM (SELECT DISTINCT bucket FROM due) b;

-- name: waiting_keys
-- After the switch: the keys whose events wait in the projection's park (a head retrying, or held by a
-- pause), with their head; what a rebuild that can not call itself clean reports.
SELECT p.partition_key,
       (array_agg(p.event_id ORDER BY p.place))[1] AS head,
       (array_agg(p.attempts ORDER BY p.place))[1] AS attempts,
       (array_agg(p.last_error ORDER BY p.place))[1] AS last_error,
       count(*) AS parked,
       bool_or(k.partition_key IS NOT NULL) AS paused
FROM outbox.parked p
LEFT JOIN outbox.paused_keys k ON k.sink = p.sink AND k.partition_key = p.partition_key
WHERE p.sink = %(live)s
GROUP BY p.partition_key
ORDER BY p.partition_key
LIMIT 100;

-- name: adopt_history
-- The new model's history began where the rebuild's did (a partial rebuild accepted moves it on).
UPDATE outbox.sinks l
SET history_from = r.history_from, history_since = r.history_since
FROM outbox.sinks r
WHERE l.name = %(live)s AND r.name = %(rebuild)s;

-- name: history_gap
-- What retention removed, after a sink's history began, of partitions that held the topics it reads (NULL: all), per class and topics (0015); no row: nothing is missing.
SELECT h.class, h.topics, h.except_topics, h.removed_through, h.removed_xid::text::bigint, h.removed_events
FROM outbox.history_removed h
JOIN outbox.sinks s ON s.name = %(sink)s
WHERE h.removed_at > s.history_since
  AND outbox.history_covers_v1(h.topics, h.except_topics, %(topics)s::text[])
ORDER BY h.class, h.removed_through;

-- name: stored_from
-- From when events of these topics (NULL: all) are stored: the oldest event of the partitions that may hold them.
SELECT outbox.history_stored_from_v1(%(topics)s::text[]);

-- name: adopt_parked
-- The rebuild's retries carry on under the live name (run after drop_parked_and_dead).
UPDATE outbox.parked SET sink = %(live)s WHERE sink = %(rebuild)s;

-- name: adopt_dead_letters
-- Likewise its dead letters.
UPDATE outbox.dead_letters SET sink = %(live)s WHERE sink = %(rebuild)s;

-- name: key_cursor
-- Rebuild of one key: lock its bucket's live cursor (the live relay's checkpoint for that
-- bucket waits) and read how far live processing got.
SELECT c.snapshot::text, c.target::text, c.fence, c.after_xid::text, c.after_seq
FROM outbox.cursors c
WHERE c.sink = %(sink)s AND c.bucket = outbox.bucket_v1(%(key)s)
FOR UPDATE;

-- name: key_history
-- The events of one key that live processing applied: up to the cursor, neither parked nor
-- dead-lettered, in publish order.
SELECT e.bucket, e.xid::text::bigint AS xid, e.seq, e.id, e.partition_key, e.topic, e.type,
       e.payload::text AS payload, e.headers::text AS headers, coalesce(e.occurred_at, e.created_at) AS time,
       e.schema_version AS version
FROM outbox.events e
WHERE e.bucket = outbox.bucket_v1(%(key)s) AND e.partition_key = %(key)s
  AND outbox.delivered_v1(e.xid, e.seq, %(seen)s::pg_snapshot, %(target)s::pg_snapshot, %(after_xid)s::xid8,
                          %(after_seq)s::bigint)
  AND (%(types)s::text[] IS NULL OR e.type = ANY(%(types)s::text[]))
  AND (%(topics)s::text[] IS NULL OR e.topic = ANY(%(topics)s::text[]))
  AND NOT EXISTS (SELECT 1 FROM outbox.parked p
                  WHERE p.sink = %(sink)s AND p.bucket = e.bucket AND p.xid = e.xid AND p.seq = e.seq)
  AND NOT EXISTS (SELECT 1 FROM outbox.dead_letters d WHERE d.sink = %(sink)s AND d.event_id = e.id)
ORDER BY e.xid, e.seq;

-- name: bulk_lock
-- A lane of the bulk phase of one rebuild runs in one process at a time: a session lock per lane held
-- by the connection that commits the lane's slices (it goes with the session, and so does any slice in
-- flight).
SELECT pg_try_advisory_lock(hashtextextended('outbox-relay rebuild bulk ' || %(projection)s || ' lane '
                                             || %(lane)s::int, 0));

-- name: bulk_unlock
-- The lane is over or stopped here: let another process look at it (it finds it over, or resumes it).
SELECT pg_advisory_unlock(hashtextextended('outbox-relay rebuild bulk ' || %(projection)s || ' lane '
                                           || %(lane)s::int, 0));

-- name: bulk_state
-- Whether a lane (the buckets lo <= bucket < hi) is still in the rebuild's bulk phase, and where: while
-- it is, every bucket of the lane has the same cursor and no relay has taken one (fence 0); the lane's
-- last slice bumps their fences (bulk_advance).
SELECT count(*) AS buckets,
       count(DISTINCT concat_ws('/', c.snapshot::text, coalesce(c.target::text, '-'),
                                coalesce(c.after_xid::text, '-'), coalesce(c.after_seq::text, '-'))) AS cursors,
       bool_and(c.fence = 0 AND c.owner IS NULL) AS untaken,
       min(c.snapshot::text) AS seen, min(c.target::text) AS target,
       min(c.after_xid::text) AS after_xid, min(c.after_seq) AS after_seq,
       pg_current_snapshot()::text AS now
FROM outbox.cursors c
JOIN outbox.rebuilds r ON r.sink = c.sink AND r.started_at = %(started_at)s
WHERE c.sink = %(sink)s AND c.bucket >= %(lo)s AND c.bucket < %(hi)s;

-- name: bulk_read_session
-- The session that reads a rebuild's slices (bulk_read, and nothing else): no sorts where an ordered
-- path exists. bulk_read's only good plan walks events_xid in order. The planner estimates each snapshot
-- test at a third and the lane's condition (lo <= bucket < hi) at its share, so a slice looks like most of
-- the delta, and reading the whole delta (a sequential or bitmap scan, or events_position's bucket range)
-- then sorting it looks cheaper: measured on PostgreSQL 15 and 18 (tests/integration/test_rebuild_plan.py).
SET enable_sort = off;

-- name: bulk_read
-- One slice of a lane of the bulk phase: the events of the lane's buckets (lo <= bucket < hi) in the
-- target snapshot's delta from the cursor's seen snapshot, in (xid, seq) order, after the last one
-- delivered. An index range scan per xid partition (events_xid: (xid, seq + 0), 0017), walked in xid
-- order, from the last event delivered even inside a large transaction; no per-bucket probes. The other
-- lanes' events are read and dropped (bucket is not in that index): about LANES rows read per row
-- returned. Run in a bulk_read_session. (seq + 0 is seq: the expression of the index.)
SELECT e.bucket, e.xid::text::bigint AS xid, e.seq, e.id, e.partition_key, e.topic, e.type,
       e.payload::text AS payload, e.headers::text AS headers, coalesce(e.occurred_at, e.created_at) AS time,
       e.schema_version AS version
FROM outbox.events e
WHERE e.xid >= %(lo_xid)s::xid8
  AND (e.xid, e.seq + 0) > (%(lo_xid)s::xid8, %(lo_seq)s::bigint)
  AND e.xid < pg_snapshot_xmax(%(target)s::pg_snapshot)
  AND pg_visible_in_snapshot(e.xid, %(target)s::pg_snapshot)
  AND NOT pg_visible_in_snapshot(e.xid, %(seen)s::pg_snapshot)
  AND e.bucket >= %(lo)s AND e.bucket < %(hi)s
  AND (%(types)s::text[] IS NULL OR e.type = ANY(%(types)s::text[]))
  AND (%(topics)s::text[] IS NULL OR e.topic = ANY(%(topics)s::text[]))
ORDER BY e.xid, e.seq + 0
LIMIT %(limit)s;

-- name: bulk_advance
-- A slice's checkpoint, in its transaction: the cursor of every bucket of its lane (lo <= bucket < hi)
-- moves to the slice's last event of the target's delta (or past the delta when it was the last slice),
-- only if those cursors are still where this process left them and the rebuild is still its (a process
-- that lost the lane, or whose rebuild was cancelled or restarted, changes nothing: 0 rows, and it rolls
-- back). ``fence_by`` 1 ends the lane's bulk phase with it.
UPDATE outbox.cursors c
SET snapshot = %(new_seen)s::pg_snapshot, target = %(new_target)s::pg_snapshot,
    after_xid = %(new_after_xid)s::xid8, after_seq = %(new_after_seq)s,
    fence = c.fence + %(fence_by)s, advanced_at = clock_timestamp()
WHERE c.sink = %(sink)s AND c.bucket >= %(lo)s AND c.bucket < %(hi)s AND c.fence = 0 AND c.owner IS NULL
  AND c.snapshot::text = %(seen)s
  AND c.target::text IS NOT DISTINCT FROM %(target)s
  AND c.after_xid IS NOT DISTINCT FROM %(after_xid)s::xid8
  AND c.after_seq IS NOT DISTINCT FROM %(after_seq)s::bigint
  AND EXISTS (SELECT 1 FROM outbox.rebuilds r WHERE r.sink = c.sink AND r.started_at = %(started_at)s)
RETURNING c.bucket;

-- name: lock_live_cursors
-- The switch, next: the live projection can not checkpoint (so can not move on) until it commits.
SELECT bucket FROM outbox.cursors WHERE sink = %(live)s ORDER BY bucket FOR UPDATE;

-- name: behind_live
-- Buckets where the live projection applied an event (its cursor passed it) that the rebuild has not:
-- swapped in now, the new model would lack an event a reader may have seen (wait_for) until the live
-- projection applied it again from the rebuild's cursor. One probe per bucket, from the xmin of the
-- rebuild cursor's snapshot (what it has not delivered is its delta: small once it caught up).
SELECT count(*)
FROM outbox.cursors l
JOIN outbox.cursors r ON r.sink = %(rebuild)s AND r.bucket = l.bucket
CROSS JOIN LATERAL (
    SELECT 1
    FROM outbox.events e
    WHERE e.bucket = l.bucket
      AND e.xid >= pg_snapshot_xmin(r.snapshot)
      AND NOT outbox.delivered_v1(e.xid, e.seq, r.snapshot, r.target, r.after_xid, r.after_seq)
      AND outbox.delivered_v1(e.xid, e.seq, l.snapshot, l.target, l.after_xid, l.after_seq)
      AND (%(types)s::text[] IS NULL OR e.type = ANY(%(types)s::text[]))
      AND (%(topics)s::text[] IS NULL OR e.topic = ANY(%(topics)s::text[]))
    LIMIT 1
) behind
WHERE l.sink = %(live)s;

-- name: live_decisions
-- What the live projection decided about the events of a rebuild's batch, by the batch's transaction id
-- range (projections/decisions.py): dead letters (skipped by an operator, past their attempts, not
-- applicable), which the replay records as dead with the same reason, and parked events (retrying, queued,
-- a paused key's) and events of a key paused live that live has not read yet, which it holds. Index range scans (dead_letters_sink_position, 0020; the park by its primary
-- key's sink prefix: it holds what waits now, a few rows).
SELECT d.event_id, d.last_error, false AS held
FROM outbox.dead_letters d
WHERE d.sink = %(live)s AND d.xid >= %(lo)s::text::xid8 AND d.xid <= %(hi)s::text::xid8
UNION ALL
SELECT p.event_id, NULL, true
FROM outbox.parked p
WHERE p.sink = %(live)s AND p.xid >= %(lo)s::text::xid8 AND p.xid <= %(hi)s::text::xid8
UNION ALL
-- Events of keys paused live that live processing has not read yet: it will hold them when it does.
SELECT e.id, NULL, true
FROM outbox.paused_keys k
JOIN outbox.cursors c ON c.sink = k.sink AND c.bucket = k.bucket
JOIN outbox.events e ON e.bucket = k.bucket AND e.partition_key = k.partition_key
                    AND e.xid >= %(lo)s::text::xid8 AND e.xid <= %(hi)s::text::xid8
WHERE k.sink = %(live)s
  AND NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq);

-- name: bulk_dead_letters
-- A bulk-phase slice's events that the live projection dead-lettered, dead-lettered for the rebuild too (as
-- the relay's checkpoint records a dead letter), in the slice's transaction.
INSERT INTO outbox.dead_letters (sink, event_id, bucket, xid, seq, partition_key, attempts, last_error)
SELECT %(sink)s, d.event_id, d.bucket, d.xid, d.seq, d.partition_key, d.attempts, d.last_error
FROM outbox.dead_letters d
WHERE d.sink = %(live)s AND d.event_id = ANY(%(ids)s::uuid[])
ON CONFLICT (sink, event_id) DO NOTHING;
