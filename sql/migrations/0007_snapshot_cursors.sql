-- 0007_snapshot_cursors: read events in the order their transactions became visible (PgQ-style),
-- so that one long writing transaction anywhere on the server no longer holds delivery back; wake
-- only the relays that own the buckets a commit touched; assign buckets to relays through a stored,
-- balanced table instead of a hash ring.
-- min-code-version: 7
--
-- Before, a cursor was a position (xid, seq) and a relay read only below the snapshot's xmin: every
-- open writing transaction on the server (a relay's own checkpoint included) held every relay back.
-- Now a cursor is a snapshot: every event of a transaction visible in it was delivered. The next read
-- is the delta: transactions visible now that were not then, at or above its xmax or in its xip list
-- (open then, committed since). outbox_relay/positions.py has the model; a delta larger than a batch
-- is read in pages from a pinned target snapshot, after the last event delivered.
--
-- Relays of earlier versions read positions that no longer exist: stop them before migrating.

ALTER TABLE outbox.cursors
    ADD COLUMN snapshot  pg_snapshot,
    ADD COLUMN target    pg_snapshot,
    ADD COLUMN after_xid xid8,
    ADD COLUMN after_seq bigint;

-- A position (x, s) delivered everything below x, and x itself up to s: seen 'x:x:', then the rest
-- of x as the delta of target 'x+1:x+1:' after (x, s). Position zero: nothing delivered.
UPDATE outbox.cursors
SET snapshot  = CASE WHEN position_xid = '0' THEN '1:1:'
                     ELSE (position_xid::text || ':' || position_xid::text || ':') END::pg_snapshot,
    target    = CASE WHEN position_xid = '0' THEN NULL
                     ELSE ((position_xid::text::bigint + 1)::text || ':' || (position_xid::text::bigint + 1)::text
                           || ':')::pg_snapshot END,
    after_xid = CASE WHEN position_xid = '0' THEN NULL ELSE position_xid END,
    after_seq = CASE WHEN position_xid = '0' THEN NULL ELSE position_seq END;

ALTER TABLE outbox.cursors
    ALTER COLUMN snapshot SET DEFAULT '1:1:',
    ALTER COLUMN snapshot SET NOT NULL,
    DROP COLUMN position_xid,
    DROP COLUMN position_seq;

-- Whether a sink's cursor has delivered an event (positions.Cursor.delivered).
CREATE FUNCTION outbox.delivered_v1(xid xid8, seq bigint, snapshot pg_snapshot, target pg_snapshot,
                                    after_xid xid8, after_seq bigint)
    RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN pg_visible_in_snapshot(xid, snapshot)
        OR (target IS NOT NULL AND pg_visible_in_snapshot(xid, target) AND (xid, seq) <= (after_xid, after_seq));

-- Whether a bucket of a sink has something deliverable now (a lease lapse counts only then): a
-- committed event its cursor has not delivered, or a parked event whose retry is due. The two
-- probes are the two halves of a delta: transactions open at the cursor's snapshot, and later ones.
CREATE FUNCTION outbox.bucket_has_work_v2(sink text, bucket integer, snapshot pg_snapshot, target pg_snapshot,
                                          after_xid xid8, after_seq bigint)
    RETURNS boolean
    LANGUAGE sql STABLE PARALLEL SAFE
    RETURN EXISTS (SELECT 1 FROM outbox.events e
                   WHERE e.bucket = bucket_has_work_v2.bucket
                     AND (e.xid >= pg_snapshot_xmax(bucket_has_work_v2.snapshot)
                          OR e.xid IN (SELECT pg_snapshot_xip(bucket_has_work_v2.snapshot)))
                     AND NOT outbox.delivered_v1(e.xid, e.seq, bucket_has_work_v2.snapshot, bucket_has_work_v2.target,
                                                 bucket_has_work_v2.after_xid, bucket_has_work_v2.after_seq))
        OR EXISTS (SELECT 1 FROM outbox.parked p
                   WHERE p.sink = bucket_has_work_v2.sink AND p.bucket = bucket_has_work_v2.bucket
                     AND p.available_at <= clock_timestamp());
DROP FUNCTION outbox.bucket_has_work_v1(text, integer, xid8, bigint);

-- Wake only the relays that own a touched bucket: the notification carries the buckets a statement
-- wrote (Postgres folds identical notifications of one transaction). Polling stays the baseline.
CREATE FUNCTION outbox.notify_events_v2() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_events_v2', (SELECT string_agg(DISTINCT n.bucket::text, ',') FROM new_events n));
    RETURN NULL;
END
$$;

DROP TRIGGER events_notify ON outbox.events;
DROP FUNCTION outbox.notify_events_v1();
CREATE TRIGGER events_notify AFTER INSERT ON outbox.events
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.notify_events_v2();

-- Which relay should hold which bucket of a sink (outbox_relay/assignment.py): balanced within one
-- bucket and changed only when the sink's live members change, by whichever relay notices first
-- (compare-and-set on generation), so that a join or leave moves only the ideal share of buckets.
CREATE TABLE outbox.assignments (
    sink       text        NOT NULL,
    generation bigint      NOT NULL,
    members    text[]      NOT NULL,  -- the live relays it was made for, sorted
    owners     text[]      NOT NULL,  -- owners[b + 1]: the relay that should hold bucket b
    changed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT assignments_pkey PRIMARY KEY (sink),
    CONSTRAINT assignments_sink_fkey FOREIGN KEY (sink) REFERENCES outbox.sinks (name) ON DELETE CASCADE
);
