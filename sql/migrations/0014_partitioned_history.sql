-- 0014_partitioned_history: outbox.events is partitioned, and history leaves by whole partitions.
--
-- Until now retention DELETEd old delivered events row by row: dead tuples, vacuum work and an
-- ever-growing table for installations that keep history. Now (docs/history.md):
--
-- - outbox.events is PARTITION BY RANGE (xid): a relay's read (the events of transactions in
--   [xmin, xmax) of two snapshots) is an xid range, so it prunes to the newest partitions whatever
--   the size of history; time partitions could not prune a read by xid. Each range partition is
--   PARTITION BY LIST (topic): one leaf per retention class (outbox.retention_classes, topics mapped
--   by outbox.topic_retention) and a DEFAULT leaf for the default class (every other topic, and
--   events without one). Retention drops a leaf once every sink has passed its xid range and its
--   class's retention has elapsed (outbox.retire_partition_v1): no row is ever deleted.
-- - Housekeeping creates range partitions ahead (outbox.add_partition_v1, sized from the observed
--   xid rate to cover about --partition-seconds). outbox.events_default (the DEFAULT range partition)
--   takes events whose xid no range covers, so no insert ever fails; new ranges start above its
--   rows, and it is emptied with TRUNCATE once all of its events may go.
-- - A unique index on a partitioned table must contain the partition key, while an idempotency key
--   is unique per topic across all of history. Keys move to outbox.idempotency_keys, filled by
--   events_check: an INSERT whose key already stands for an event is skipped (as ON CONFLICT DO
--   NOTHING did); the key leaves with its event's partition (G2: for as long as the event is kept).
--   Producers that wrote `ON CONFLICT (...) DO NOTHING` drop that clause (docs/sql-producers.md).
-- - Event ids are no longer unique by index (the same reason); they are random or time-ordered
--   UUIDs made by the library or the database, and explicit ids are checked (insert_checked).
--
-- Conversion: the existing table becomes the partition outbox.events_legacy, covering every xid up to
-- this migration's: its events keep their positions (xid, seq), so every cursor stays valid and each
-- event is delivered once, in order. It holds all topics, so it goes when its newest event is past the
-- longest retention of any class (never, while a class keeps history for good). The table is locked
-- while its indexes are rebuilt as the partitioned table's (minutes for tens of millions of rows).
--
-- Relays of the previous version keep running (their reads and checkpoints work on the partitioned
-- table). Their row-by-row retention is refused (events_no_delete: a DELETE by ctid on a partitioned
-- table would name rows of every partition); it logs an error each housekeeping pass until they are
-- replaced, and removes nothing. Producers of the previous version that publish with idempotency keys
-- fail (their ON CONFLICT target is gone): upgrade producers together with this migration.

LOCK TABLE outbox.events IN ACCESS EXCLUSIVE MODE;

-- The existing table, to become a partition: the partitioned table's own identity, constraints,
-- indexes and trigger replace its.
-- bucket_has_work_v2's SQL body names the table it was created for, not the name: made again below,
-- unchanged, for the new table.
DROP FUNCTION outbox.bucket_has_work_v2(text, integer, pg_snapshot, pg_snapshot, xid8, bigint);
ALTER TABLE outbox.events RENAME TO events_legacy;
DROP TRIGGER events_check ON outbox.events_legacy;
CREATE TEMPORARY TABLE outbox_0014 ON COMMIT DROP AS
SELECT coalesce((SELECT max(seq) FROM outbox.events_legacy), 0) AS last_seq,
       pg_current_xact_id() AS migration_xid,
       EXISTS (SELECT FROM outbox.events_legacy) AS has_rows;
ALTER TABLE outbox.events_legacy ALTER COLUMN seq DROP IDENTITY;
ALTER TABLE outbox.events_legacy DROP CONSTRAINT events_pkey;
DROP INDEX outbox.events_position;
DROP INDEX outbox.events_idempotency_key;
ALTER INDEX outbox.events_created_at RENAME TO events_legacy_created_at_idx;
ALTER INDEX outbox.events_xid RENAME TO events_legacy_xid_idx;
-- PostgreSQL 18 names NOT NULL constraints uniquely per schema: free the names for the new table's.
DO $$
DECLARE
    con text;
BEGIN
    FOR con IN SELECT conname FROM pg_constraint
               WHERE conrelid = 'outbox.events_legacy'::regclass AND contype = 'n' AND conname LIKE 'events\_%' LOOP
        EXECUTE format('ALTER TABLE outbox.events_legacy RENAME CONSTRAINT %I TO %I',
                       con, 'events_legacy_' || substr(con, 8));
    END LOOP;
END
$$;

CREATE TABLE outbox.events (
    id              uuid        NOT NULL DEFAULT gen_random_uuid(),
    xid             xid8        NOT NULL DEFAULT pg_current_xact_id(),
    seq             bigint      NOT NULL GENERATED ALWAYS AS IDENTITY,
    partition_key   text        NOT NULL
                    CONSTRAINT events_key_valid
                    CHECK (partition_key <> '' AND octet_length(partition_key) <= 1024),
    bucket          integer     NOT NULL GENERATED ALWAYS AS (outbox.bucket_v1(partition_key)) STORED,
    topic           text,
    type            text        NOT NULL CONSTRAINT events_type_valid CHECK (type <> ''),
    payload         jsonb       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    occurred_at     timestamptz,
    idempotency_fingerprint bytea,
    schema_version  integer     NOT NULL DEFAULT 1,
    CONSTRAINT events_schema_version_valid CHECK (schema_version BETWEEN 1 AND 32767)
) PARTITION BY RANGE (xid);

-- Same privileges as the table it replaces (docs/roles.md).
DO $$
DECLARE
    columns text;
BEGIN
    -- Table-level grants.
    FOR columns IN
        SELECT format('GRANT %s ON outbox.events TO %s', p.privilege_type,
                      CASE WHEN p.grantee = 'PUBLIC' THEN 'PUBLIC' ELSE quote_ident(p.grantee) END)
        FROM information_schema.table_privileges p
        WHERE p.table_schema = 'outbox' AND p.table_name = 'events_legacy' AND p.grantee <> current_user
    LOOP
        EXECUTE columns;
    END LOOP;
    -- Column-level grants (those not implied by a table-level one).
    FOR columns IN
        SELECT format('GRANT %s (%s) ON outbox.events TO %s', c.privilege_type,
                      string_agg(quote_ident(c.column_name), ', '),
                      CASE WHEN c.grantee = 'PUBLIC' THEN 'PUBLIC' ELSE quote_ident(c.grantee) END)
        FROM information_schema.column_privileges c
        WHERE c.table_schema = 'outbox' AND c.table_name = 'events_legacy' AND c.grantee <> current_user
          AND NOT EXISTS (SELECT FROM information_schema.table_privileges t
                          WHERE t.table_schema = 'outbox' AND t.table_name = 'events_legacy'
                            AND t.grantee = c.grantee AND t.privilege_type = c.privilege_type)
        GROUP BY c.privilege_type, c.grantee
    LOOP
        EXECUTE columns;
    END LOOP;
END
$$;

-- The read path (fetch_events): per held bucket, index probes for the cursor's xip ids that ended
-- and one range from its xmax, in the newest partitions only. Not unique: a unique index on a
-- partitioned table must hold every partition key (seq is an identity: unique anyway).
CREATE INDEX events_position ON outbox.events (bucket, xid, seq);
-- Events by id (replay, progress, explicit ids checked by insert_checked).
CREATE INDEX events_id ON outbox.events (id);
-- Time-based replay and rebuild, and the newest event of a partition (retention).
CREATE INDEX events_created_at ON outbox.events (created_at);
-- Commits since a snapshot (0010, outbox.watch_commits_v1): one range from its xmax, one probe per open id.
CREATE INDEX events_xid ON outbox.events (xid);

-- Whether a bucket of a sink has something deliverable now (as before 0014; see schema.sql).
CREATE FUNCTION outbox.bucket_has_work_v2(sink text, bucket integer, snapshot pg_snapshot, target pg_snapshot,
                                          after_xid xid8, after_seq bigint)
    RETURNS boolean
    LANGUAGE sql STABLE PARALLEL SAFE
    RETURN EXISTS (SELECT 1 FROM outbox.events e
                   WHERE e.bucket = bucket_has_work_v2.bucket
                     -- 0014: implied by the next line; written out so that older partitions are not probed.
                     AND e.xid >= pg_snapshot_xmin(bucket_has_work_v2.snapshot)
                     AND (e.xid >= pg_snapshot_xmax(bucket_has_work_v2.snapshot)
                          OR e.xid IN (SELECT pg_snapshot_xip(bucket_has_work_v2.snapshot)))
                     AND NOT outbox.delivered_v1(e.xid, e.seq, bucket_has_work_v2.snapshot, bucket_has_work_v2.target,
                                                 bucket_has_work_v2.after_xid, bucket_has_work_v2.after_seq))
        OR EXISTS (SELECT 1 FROM outbox.parked p
                   WHERE p.sink = bucket_has_work_v2.sink AND p.bucket = bucket_has_work_v2.bucket
                     AND p.available_at <= clock_timestamp()
                     AND NOT EXISTS (SELECT 1 FROM outbox.paused_keys k
                                     WHERE k.sink = p.sink AND k.partition_key = p.partition_key));

-- Commits since a snapshot (0010), with the xid bound written out for partition pruning (0014).
CREATE OR REPLACE FUNCTION outbox.watch_commits_v1(since pg_snapshot, wait_ms integer, interval_ms double precision,
                                        OUT snapshot pg_snapshot, OUT buckets text)
    LANGUAGE plpgsql AS $$
DECLARE
    deadline timestamptz := clock_timestamp() + make_interval(secs => wait_ms / 1000.0);
    later    xid8;    -- transactions that started after the last look have ids from here on
    open_ids xid8[];  -- ... and these were open at the last look
    seen     integer;
BEGIN
    IF since IS NULL THEN
        snapshot := pg_current_snapshot();
        RETURN;
    END IF;
    LOOP
        later := pg_snapshot_xmax(since);
        open_ids := ARRAY(SELECT pg_snapshot_xip(since));
        -- One statement, so that the snapshot returned is the one the scans saw. PL/pgSQL caches a
        -- generic plan of it: the ORDER BY ... LIMIT keeps that plan on the index whatever the
        -- table's size (tests/integration/test_quiet_producers.py counts its scans).
        SELECT pg_current_snapshot(), count(*)::integer, string_agg(DISTINCT n.bucket::text, ',')
        INTO snapshot, seen, buckets
        FROM (-- Ids from `later` up to this snapshot's xmax: a newer id can not be visible yet (a running
              -- transaction newer than every finished one is not read at every look).
              (SELECT e.bucket FROM outbox.events e
               WHERE e.xid >= later AND e.xid < pg_snapshot_xmax(pg_current_snapshot())
               ORDER BY e.xid LIMIT 10001)
              UNION ALL
              -- Only the open ones that have committed by now (in this statement's snapshot): one still
              -- open (a bulk load, say) is not probed, so its uncommitted rows are not visited at every look.
              (SELECT e.bucket FROM outbox.events e
               WHERE e.xid = ANY (ARRAY(SELECT x FROM unnest(open_ids) AS x
                                        WHERE pg_visible_in_snapshot(x, pg_current_snapshot())))
                 -- 0014: implied by the line above; only the partitions from the snapshot's xmin are probed.
                 AND e.xid >= pg_snapshot_xmin(since)
               ORDER BY e.xid LIMIT 10001)) n;
        IF seen > 10000 THEN
            buckets := '*';
        END IF;
        IF buckets IS NOT NULL THEN
            PERFORM pg_notify('outbox_events_v2', buckets);
            RETURN;
        END IF;
        EXIT WHEN clock_timestamp() >= deadline;
        since := snapshot;
        PERFORM pg_sleep(interval_ms / 1000.0);
    END LOOP;
END
$$;

-- Producer idempotency: one event per key and topic (scope: coalesce(topic, '')) for as long as the
-- event is kept; rows leave with their event's partition (retire_partition_v1).
CREATE TABLE outbox.idempotency_keys (
    scope       text        NOT NULL,
    key         text        NOT NULL,
    event_id    uuid        NOT NULL,
    -- fingerprint_v1(type, partition_key, payload) of the event (NULL: stored before 0005; counts as the same).
    fingerprint bytea,
    -- The event's transaction: which partition holds it.
    xid         xid8        NOT NULL DEFAULT pg_current_xact_id(),
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (scope, key)
);
-- Retention: the keys of a partition's xid range.
CREATE INDEX idempotency_keys_xid ON outbox.idempotency_keys (xid);
INSERT INTO outbox.idempotency_keys (scope, key, event_id, fingerprint, xid)
SELECT coalesce(topic, ''), idempotency_key, id, idempotency_fingerprint, xid
FROM outbox.events_legacy WHERE idempotency_key IS NOT NULL;

-- Whoever may publish may read keys (publish tells a retry from a reuse by the stored fingerprint).
DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT p.grantee FROM information_schema.column_privileges p
        WHERE p.table_schema = 'outbox' AND p.table_name = 'events_legacy' AND p.column_name = 'idempotency_key'
          AND p.privilege_type = 'INSERT' AND p.grantee <> current_user
    LOOP
        EXECUTE format('GRANT SELECT ON outbox.idempotency_keys TO %s',
                       CASE WHEN grantee = 'PUBLIC' THEN 'PUBLIC' ELSE quote_ident(grantee) END);
    END LOOP;
END
$$;

-- Retention classes: how long the events of a class's topics are kept (keep NULL: for good). The class
-- 'default' (every topic not mapped) keeps the relays' --retention-seconds unless a row names it.
CREATE TABLE outbox.retention_classes (
    name       text        NOT NULL CONSTRAINT retention_classes_name_valid CHECK (name ~ '^[a-z][a-z0-9_]{0,29}$'),
    keep       interval    CONSTRAINT retention_classes_keep_valid CHECK (keep >= interval '0'),
    changed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT retention_classes_pkey PRIMARY KEY (name)
);

-- Which class a topic's events belong to (topics not listed: 'default'). A change applies to the
-- partitions created after it (a leaf's topics are fixed when it is created).
CREATE TABLE outbox.topic_retention (
    topic      text        NOT NULL,
    class      text        NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT topic_retention_pkey PRIMARY KEY (topic),
    CONSTRAINT topic_retention_class_fkey FOREIGN KEY (class) REFERENCES outbox.retention_classes (name),
    CONSTRAINT topic_retention_class_valid CHECK (class <> 'default')
);

-- The leaves of outbox.events and what they hold: a range partition's class leaves (topics: the LIST
-- values; NULL: its DEFAULT leaf, class 'default'), and the mixed ones (class NULL: every topic):
-- events_default and events_legacy. Kept in the transactions that create and drop them.
CREATE TABLE outbox.partitions (
    name        text        NOT NULL,
    range_name  text,                  -- the range partition it belongs to (NULL: a mixed leaf)
    class       text,
    topics      text[],
    xid_from    xid8,                  -- its xid range [xid_from, xid_to) (NULL: mixed, read from its rows)
    xid_to      xid8,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    created_xid xid8        NOT NULL DEFAULT pg_current_xact_id(),  -- sizes the next range (xid rate)
    CONSTRAINT partitions_pkey PRIMARY KEY (name)
);

CREATE TABLE outbox.events_default PARTITION OF outbox.events DEFAULT;
INSERT INTO outbox.partitions (name) VALUES ('events_default');

-- The old rows: one partition below every xid from now on (a transaction older than this migration's
-- that inserts later lands there too).
DO $$
BEGIN
    IF (SELECT has_rows FROM outbox_0014) THEN
        EXECUTE format('ALTER TABLE outbox.events ATTACH PARTITION outbox.events_legacy FOR VALUES FROM (%L) TO (%L)',
                       '0', (SELECT migration_xid FROM outbox_0014));
        INSERT INTO outbox.partitions (name, xid_to) SELECT 'events_legacy', migration_xid FROM outbox_0014;
        EXECUTE format('ALTER TABLE outbox.events ALTER COLUMN seq RESTART WITH %s',
                       (SELECT last_seq + 1 FROM outbox_0014));
    ELSE
        DROP TABLE outbox.events_legacy;
    END IF;
END
$$;

-- Record an idempotency key for an event being inserted; false: the key stands for an event already
-- (committed, or earlier in this transaction). As the schema's owner, so that producers need no
-- INSERT on outbox.idempotency_keys (they may read it: publish tells a retry from a reuse).
CREATE FUNCTION outbox.claim_idempotency_key_v1(scope text, key text, event_id uuid, fingerprint bytea, xid xid8)
    RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO outbox.idempotency_keys AS k (scope, key, event_id, fingerprint, xid)
    VALUES (claim_idempotency_key_v1.scope, claim_idempotency_key_v1.key, claim_idempotency_key_v1.event_id,
            claim_idempotency_key_v1.fingerprint, claim_idempotency_key_v1.xid)
    ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO NOTHING;
    RETURN FOUND;
END
$$;

-- Refuse an event the relays could not position, keep, or deliver; fingerprint an idempotent event
-- and record its key, skipping the row (NULL) when the key already stands for an event: the outcome
-- ON CONFLICT DO NOTHING gave on the unique index that 0014 replaced. Otherwise check_event_v2.
CREATE FUNCTION outbox.check_event_v3() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    name  text;
    value jsonb;
BEGIN
    IF NEW.xid IS DISTINCT FROM pg_current_xact_id() THEN
        RAISE EXCEPTION 'outbox.events.xid is set by the database (the inserting transaction''s id), not by producers'
            USING ERRCODE = 'check_violation', HINT = 'leave xid out of the INSERT';
    END IF;
    IF NEW.created_at IS DISTINCT FROM now() THEN
        RAISE EXCEPTION 'outbox.events.created_at is set by the database (retention counts from it), not by producers'
            USING ERRCODE = 'check_violation', HINT = 'put the event''s own time in occurred_at';
    END IF;
    -- Kafka's rule for topic names.
    IF NEW.topic IS NOT NULL
       AND (NEW.topic !~ '^[A-Za-z0-9._-]+$' OR length(NEW.topic) > 249 OR NEW.topic IN ('.', '..')) THEN
        RAISE EXCEPTION 'outbox.events.topic % is not a Kafka topic name', quote_literal(left(NEW.topic, 300))
            USING ERRCODE = 'check_violation', HINT = '1-249 of A-Z a-z 0-9 . _ -, and not "." or ".."';
    END IF;
    IF NEW.headers <> '{}'::jsonb THEN
        IF jsonb_typeof(NEW.headers) <> 'object' THEN
            RAISE EXCEPTION 'outbox.events.headers must be a JSON object of strings, not a JSON %',
                jsonb_typeof(NEW.headers) USING ERRCODE = 'check_violation';
        END IF;
        FOR name, value IN SELECT e.key, e.value FROM jsonb_each(NEW.headers) AS e LOOP
            IF jsonb_typeof(value) <> 'string' THEN
                RAISE EXCEPTION 'outbox.events.headers: the value of % is a JSON %, not a string',
                    quote_literal(name), jsonb_typeof(value) USING ERRCODE = 'check_violation';
            END IF;
            -- The relay's own headers (outbox_relay.event.RESERVED_HEADERS): consumers must see one value.
            -- Compared as outbox_relay.event.header_name_key does, so that no lookalike (CE-ID, fullwidth
            -- letters, a zero-width or trailing space) passes for another name on a consumer's screen.
            IF outbox.header_name_key_v1(name) IN ('ce_specversion', 'ce_id', 'ce_source', 'ce_type', 'ce_time',
                                                   'ce_sequence', 'ce_partitionkey', 'content_type')
               OR outbox.header_name_key_v1(name) LIKE 'outbox\_%' THEN
                RAISE EXCEPTION 'outbox.events.headers: % is reserved for the relay', quote_literal(name)
                    USING ERRCODE = 'check_violation';
            END IF;
        END LOOP;
    END IF;
    IF NEW.idempotency_key IS NOT NULL THEN
        NEW.idempotency_fingerprint := outbox.fingerprint_v1(NEW.type, NEW.partition_key, NEW.payload);
        -- Waits for a concurrent transaction holding the same key; skips the row once it committed.
        IF NOT outbox.claim_idempotency_key_v1(coalesce(NEW.topic, ''), NEW.idempotency_key, NEW.id,
                                                NEW.idempotency_fingerprint, NEW.xid) THEN
            RETURN NULL;
        END IF;
    ELSE
        NEW.idempotency_fingerprint := NULL;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER events_check BEFORE INSERT ON outbox.events
    FOR EACH ROW
    WHEN (NEW.idempotency_key IS NOT NULL
          OR NEW.headers <> '{}'::jsonb
          OR NEW.xid IS DISTINCT FROM pg_current_xact_id()
          OR NEW.created_at IS DISTINCT FROM now()
          OR NEW.topic !~ '^[A-Za-z0-9._-]{1,249}$' OR NEW.topic IN ('.', '..'))
    EXECUTE FUNCTION outbox.check_event_v3();
DROP FUNCTION outbox.check_event_v2();

-- Events leave by partition. A DELETE is refused unless the transaction says it means it
-- (SET LOCAL outbox_relay.delete_events = 'on'): relays of the previous version delete by ctid, which
-- on a partitioned table names a row in every partition.
CREATE FUNCTION outbox.events_no_delete_v1() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox_relay.delete_events', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'outbox.events: events leave by partition (retention drops whole partitions since migration 0014); '
                        'DELETE is refused'
            USING ERRCODE = 'feature_not_supported',
                  HINT = 'replace relays older than schema version 14; to delete on purpose, SET LOCAL outbox_relay.delete_events = ''on''';
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER events_no_delete BEFORE DELETE ON outbox.events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.events_no_delete_v1();

-- Create the next range partition when the newest one is more than half used (or none is ahead of
-- the current xid), sized to cover about target_seconds at the xid rate seen since the newest one was
-- made (at least min_width xids); one leaf per retention class with the topics mapped to it now, and a
-- DEFAULT leaf. Ranges start above the events in events_default. Returns the new partition's name, or
-- NULL when none was needed. Takes the table's ACCESS EXCLUSIVE lock briefly: the caller sets lock_timeout.
-- As the schema's owner (only an owner may create partitions): relays run it with EXECUTE alone.
CREATE FUNCTION outbox.add_partition_v1(min_width bigint, target_seconds double precision) RETURNS text
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    newest  outbox.partitions;
    next_id bigint := (pg_snapshot_xmax(pg_current_snapshot())::text)::bigint;  -- the next xid to be assigned
    width   bigint;
    lo      bigint;
    hi      bigint;
    rname   text;
    cls     record;
BEGIN
    IF min_width < 1 OR target_seconds <= 0 THEN
        RAISE EXCEPTION 'add_partition_v1: min_width must be >= 1 and target_seconds > 0 (got %, %)',
            min_width, target_seconds USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO newest FROM outbox.partitions p WHERE p.range_name IS NOT NULL
    ORDER BY p.xid_to DESC, p.name LIMIT 1;
    IF newest.name IS NOT NULL
       AND (newest.xid_to::text)::bigint - next_id > ((newest.xid_to::text)::bigint - (newest.xid_from::text)::bigint) / 2 THEN
        RETURN NULL;
    END IF;
    LOCK TABLE outbox.events IN ACCESS EXCLUSIVE MODE;
    IF newest.name IS NULL THEN
        width := min_width;
    ELSE
        width := greatest(min_width, ceil(((next_id - (newest.created_xid::text)::bigint)::float8)
                                         / greatest(extract(epoch FROM clock_timestamp() - newest.created_at), 1.0)
                                         * target_seconds)::bigint);
    END IF;
    lo := greatest(coalesce((newest.xid_to::text)::bigint, 0),
                   coalesce((SELECT (max(e.xid)::text)::bigint + 1 FROM outbox.events_default e), 0),
                   coalesce((SELECT (p.xid_to::text)::bigint FROM outbox.partitions p WHERE p.name = 'events_legacy'), 0));
    IF newest.name IS NULL THEN
        lo := greatest(lo, next_id);  -- the first range: from now
    END IF;
    hi := greatest(lo, next_id) + width;
    -- Ranges are numbered in the order they are made (events_p1, events_p2, ...).
    rname := 'events_p' || (coalesce((SELECT max(substr(p.range_name, 9)::bigint) FROM outbox.partitions p
                                      WHERE p.range_name IS NOT NULL), 0) + 1);
    EXECUTE format('CREATE TABLE outbox.%I PARTITION OF outbox.events FOR VALUES FROM (%L) TO (%L) PARTITION BY LIST (topic)',
                   rname, lo, hi);
    FOR cls IN
        SELECT t.class, array_agg(t.topic ORDER BY t.topic) AS topics
        FROM outbox.topic_retention t GROUP BY t.class ORDER BY t.class
    LOOP
        EXECUTE format('CREATE TABLE outbox.%I PARTITION OF outbox.%I FOR VALUES IN (%s)',
                       rname || '_' || cls.class, rname,
                       (SELECT string_agg(quote_literal(x), ', ') FROM unnest(cls.topics) AS x));
        INSERT INTO outbox.partitions (name, range_name, class, topics, xid_from, xid_to)
        VALUES (rname || '_' || cls.class, rname, cls.class, cls.topics, lo::text::xid8, hi::text::xid8);
    END LOOP;
    EXECUTE format('CREATE TABLE outbox.%I PARTITION OF outbox.%I DEFAULT', rname || '_default', rname);
    INSERT INTO outbox.partitions (name, range_name, class, topics, xid_from, xid_to)
    VALUES (rname || '_default', rname, 'default', NULL, lo::text::xid8, hi::text::xid8);
    RETURN rname;
END
$$;

-- End the range being written now at the next xid and start a new one there (with the classes' current
-- topics): a change of retention classes applies from then on, and tests get a closed range at once.
-- Ranges made ahead are empty (no xid of theirs was handed out yet): they go. Scans the rows of the
-- range it ends, under the table's ACCESS EXCLUSIVE lock (re-attached with its new bound): the caller
-- sets lock_timeout. Returns the new range's name.
CREATE FUNCTION outbox.roll_partition_v1(min_width bigint, target_seconds double precision) RETURNS text
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    next_id xid8;
    r       record;
BEGIN
    LOCK TABLE outbox.events IN ACCESS EXCLUSIVE MODE;
    next_id := pg_snapshot_xmax(pg_current_snapshot());
    FOR r IN SELECT DISTINCT p.range_name FROM outbox.partitions p
             WHERE p.range_name IS NOT NULL AND p.xid_from >= next_id LOOP
        EXECUTE format('DROP TABLE outbox.%I', r.range_name);
        DELETE FROM outbox.partitions WHERE range_name = r.range_name;
    END LOOP;
    FOR r IN SELECT DISTINCT p.range_name, p.xid_from FROM outbox.partitions p
             WHERE p.range_name IS NOT NULL AND p.xid_from < next_id AND p.xid_to > next_id LOOP
        EXECUTE format('ALTER TABLE outbox.events DETACH PARTITION outbox.%I', r.range_name);
        EXECUTE format('ALTER TABLE outbox.events ATTACH PARTITION outbox.%I FOR VALUES FROM (%L) TO (%L)',
                       r.range_name, r.xid_from, next_id);
        UPDATE outbox.partitions SET xid_to = next_id WHERE range_name = r.range_name;
    END LOOP;
    RETURN outbox.add_partition_v1(min_width, target_seconds);
END
$$;

-- The oldest event of a leaf of outbox.events (NULL: empty); one probe of its created_at index. As the
-- schema's owner, like partition_hold_v1: grants on outbox.events do not reach its partitions when read
-- directly, and `status` and the metrics run as the relays' role.
CREATE FUNCTION outbox.partition_oldest_v1(leaf text) RETURNS timestamptz
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    oldest timestamptz;
BEGIN
    EXECUTE format('SELECT min(created_at) FROM outbox.%I', leaf) INTO oldest;
    RETURN oldest;
END
$$;

-- Whether a transaction may still write events with an id in [lo, hi): ids not handed out yet, or one
-- running now (a transaction's events go to the partition of its own id). Transactions ids are
-- cluster-wide: one running in another database (pg_stat_activity, pg_prepared_xacts) writes nothing
-- here; one this role can not place counts as open.
CREATE FUNCTION outbox.range_open_v1(lo xid8, hi xid8) RETURNS boolean
    LANGUAGE sql STABLE AS $$
    SELECT pg_snapshot_xmax(pg_current_snapshot()) < hi
        OR EXISTS (SELECT FROM pg_snapshot_xip(pg_current_snapshot()) AS x
                   WHERE x >= lo AND x < hi
                     AND NOT EXISTS (SELECT FROM pg_stat_activity a
                                     WHERE a.backend_xid = x::xid AND a.datname <> current_database())
                     AND NOT EXISTS (SELECT FROM pg_prepared_xacts t
                                     WHERE t.transaction = x::xid AND t.database <> current_database()))
$$;

-- The keep of a class: NULL for good; 'default' keeps default_keep (the relays' --retention-seconds)
-- unless a row names it. NULL class (a mixed leaf: every topic): the longest keep of any class.
CREATE FUNCTION outbox.class_keep_v1(class text, default_keep interval, OUT keep interval, OUT forever boolean)
    LANGUAGE sql STABLE AS $$
    WITH keeps AS (
        SELECT coalesce((SELECT r.keep FROM outbox.retention_classes r WHERE r.name = 'default'),
                        CASE WHEN EXISTS (SELECT FROM outbox.retention_classes r WHERE r.name = 'default')
                             THEN NULL ELSE default_keep END) AS keep, 'default' AS name
        UNION ALL
        SELECT r.keep, r.name FROM outbox.retention_classes r WHERE r.name <> 'default'
    )
    SELECT max(k.keep), bool_or(k.keep IS NULL)
    FROM keeps k WHERE class_keep_v1.class IS NULL OR k.name = class_keep_v1.class
$$;

-- What keeps a leaf of outbox.events (a row of outbox.partitions) from being removed now, in words;
-- NULL: nothing (retire_partition_v1 may drop it). Checked from the cheapest reason on: its class's
-- retention, a rebuild in progress, a range still being written, a sink that has not delivered all of
-- it, a parked event or a dead letter in its xid range (a retry needs the event).
CREATE FUNCTION outbox.partition_hold_v1(leaf text, default_keep interval) RETURNS text
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    p       outbox.partitions;
    k       record;
    lo      xid8;
    hi      xid8;
    newest  timestamptz;
    who     text;
BEGIN
    SELECT * INTO p FROM outbox.partitions WHERE name = leaf;
    IF p.name IS NULL THEN
        RETURN 'no such partition';
    END IF;
    EXECUTE format('SELECT max(created_at), min(xid), max(xid) FROM outbox.%I', p.name) INTO newest, lo, hi;
    IF newest IS NULL THEN
        -- Nothing to keep: a closed range's empty leaf goes (events_default stays, empty).
        IF p.range_name IS NULL THEN
            RETURN 'empty';
        ELSIF outbox.range_open_v1(p.xid_from, p.xid_to) THEN
            RETURN 'still being written';
        END IF;
        RETURN NULL;
    END IF;
    k := outbox.class_keep_v1(p.class, default_keep);
    IF k.forever THEN
        RETURN format('retention class %s keeps history for good', coalesce(p.class, '(all classes)'));
    END IF;
    IF newest >= clock_timestamp() - k.keep THEN
        RETURN format('within retention (class %s keeps %s; newest event %s)',
                      coalesce(p.class, '(all classes)'), k.keep, newest);
    END IF;
    IF p.range_name IS NOT NULL THEN
        lo := p.xid_from;
        hi := p.xid_to;
    ELSE
        hi := (((hi::text)::bigint) + 1)::text::xid8;
    END IF;
    SELECT r.projection INTO who FROM outbox.rebuilds r ORDER BY r.started_at LIMIT 1;
    IF who IS NOT NULL THEN
        RETURN format('a rebuild of projection %s is in progress', who);
    END IF;
    IF outbox.range_open_v1(coalesce(p.xid_from, '0'::xid8), hi) THEN
        RETURN 'still being written';
    END IF;
    IF NOT EXISTS (SELECT FROM outbox.cursors) THEN
        RETURN 'no sink is registered';
    END IF;
    -- A cursor whose snapshot is past the range delivered all of it; one behind it holds the range
    -- only if its bucket has an event there it has not delivered (one index range per such cursor).
    SELECT format('sink %s has not delivered all of bucket %s', c.sink, c.bucket) INTO who
    FROM outbox.cursors c
    WHERE pg_snapshot_xmin(c.snapshot) < hi
      AND EXISTS (SELECT FROM outbox.events e
                  WHERE e.bucket = c.bucket AND e.xid >= greatest(lo, pg_snapshot_xmin(c.snapshot)) AND e.xid < hi
                    AND NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq))
    ORDER BY c.sink, c.bucket LIMIT 1;
    IF who IS NOT NULL THEN
        RETURN who;
    END IF;
    SELECT format('an event of sink %s is parked (key %s)', q.sink, q.partition_key) INTO who
    FROM outbox.parked q WHERE q.xid >= lo AND q.xid < hi LIMIT 1;
    IF who IS NOT NULL THEN
        RETURN who;
    END IF;
    SELECT format('an event of sink %s is in dead letters (retry or purge it)', d.sink) INTO who
    FROM outbox.dead_letters d WHERE d.xid >= lo AND d.xid < hi LIMIT 1;
    RETURN who;
END
$$;

-- Remove the oldest leaf that nothing holds (partition_hold_v1): drop it (events_default: TRUNCATE,
-- it stays to catch events no range covers), with its events' idempotency keys, and move the history
-- watermark (0011) past its events. Returns the leaf and how many events left with it; no row when
-- nothing may go. The caller sets lock_timeout (dropping a partition locks the table for a moment).
-- As the schema's owner (only an owner may drop partitions): relays run it with EXECUTE alone.
CREATE FUNCTION outbox.retire_partition_v1(default_keep interval,
                                           OUT leaf text, OUT removed bigint, OUT newest timestamptz)
    RETURNS SETOF record
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    p       outbox.partitions;
    bottom  xid8;
    top     xid8;
BEGIN
    FOR p IN SELECT * FROM outbox.partitions ORDER BY xid_from NULLS FIRST, name LOOP
        -- Cheap exits first, so that a pass costs little however long history is: ranges from the first
        -- one still being written on are all open; a class kept for good is never looked into.
        IF p.range_name IS NOT NULL AND outbox.range_open_v1(p.xid_from, p.xid_to) THEN
            EXIT;
        END IF;
        IF p.range_name IS NOT NULL AND (outbox.class_keep_v1(p.class, default_keep)).forever THEN
            CONTINUE;
        END IF;
        IF outbox.partition_hold_v1(p.name, default_keep) IS NOT NULL THEN
            CONTINUE;
        END IF;
        IF p.range_name IS NULL THEN
            -- A mixed leaf may still receive events: hold them off, then look again.
            EXECUTE format('LOCK TABLE outbox.%I IN ACCESS EXCLUSIVE MODE', p.name);
            IF outbox.partition_hold_v1(p.name, default_keep) IS NOT NULL THEN
                CONTINUE;
            END IF;
        END IF;
        -- Apart, so that the bounds are index probes and the count an index-only scan (together: a
        -- sequential scan of the partition).
        EXECUTE format('SELECT max(created_at), min(xid), max(xid) FROM outbox.%I', p.name) INTO newest, bottom, top;
        EXECUTE format('SELECT count(*) FROM outbox.%I', p.name) INTO removed;
        -- Its events' keys: those of its xid range (index idempotency_keys_xid) whose event it holds.
        EXECUTE format('DELETE FROM outbox.idempotency_keys k WHERE k.xid >= $1 AND k.xid <= $2 '
                       'AND EXISTS (SELECT FROM outbox.%I e WHERE e.id = k.event_id AND e.xid = k.xid)', p.name)
            USING bottom, top;
        IF removed > 0 THEN
            UPDATE outbox.history
            SET removed_through = greatest(removed_through, newest), removed_xid = greatest(removed_xid, top),
                removed_events = removed_events + removed, removed_at = clock_timestamp();
        END IF;
        IF p.name = 'events_default' THEN
            TRUNCATE outbox.events_default;
        ELSE
            EXECUTE format('DROP TABLE outbox.%I', p.name);
            DELETE FROM outbox.partitions WHERE name = p.name;
            IF p.range_name IS NOT NULL AND NOT EXISTS (SELECT FROM outbox.partitions WHERE range_name = p.range_name) THEN
                EXECUTE format('DROP TABLE outbox.%I', p.range_name);
            END IF;
        END IF;
        leaf := p.name;
        RETURN NEXT;
        RETURN;
    END LOOP;
END
$$;

-- The first range, from this migration on.
SELECT outbox.add_partition_v1(1000000, 86400);
