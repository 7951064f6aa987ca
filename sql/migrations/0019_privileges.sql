-- 0019_privileges: privileges by declaration (G13); retention goes by what is stored, not by the caller.
--
-- PostgreSQL grants EXECUTE on every new function to PUBLIC, and nothing revoked it: any role with USAGE
-- on schema outbox could call the SECURITY DEFINER functions that roll, add and retire partitions, and
-- retire_partition_v1 took the default class's keep from its caller, so `roll_partition_v1(...)` then
-- `retire_partition_v1('0 seconds')` dropped every delivered partition (and freed its idempotency keys)
-- whatever --retention-seconds said. Now (docs/roles.md):
--
-- - outbox.housekeeping.default_keep holds the default class's keep: each housekeeping pass stores its
--   relay's --retention-seconds there (only relays may update that row). retire_partition_v2() takes no
--   argument; retire_partition_v1 and partition_hold_v1 (relays of version 18) keep at least that long,
--   whatever they are passed. Existing databases start at 7 days (the default) until a relay of this
--   version runs a pass: the old relays' own value wins when it is longer.
-- - The trigger events_check records an idempotency key itself, as the schema's owner, for the row being
--   inserted: claim_idempotency_key_v1, which took a key, event id and xid from any caller, is gone.
-- - partition_oldest_v1 reads leaves of outbox.events only (it read any table of the schema it was named).
-- - Nothing in the schema is open to PUBLIC. Every explicit EXECUTE grant is taken back and given again
--   by role kind, as outbox_relay/privileges.py declares it (a frozen copy below): relays are the roles
--   granted UPDATE on outbox.housekeeping, projectors those granted INSERT on outbox.cursors otherwise,
--   producers those granted INSERT on outbox.events (or its idempotency_key column). So running relays
--   keep what they call, and projectors (docs granted them EXECUTE ON ALL FUNCTIONS) lose the partition
--   functions. Run the grants of docs/roles.md again afterwards, as after every migration.
-- - ALTER DEFAULT PRIVILEGES ... IN SCHEMA can not revoke PUBLIC's EXECUTE (a per-schema default only
--   adds to the global one), and the global form would change the migrating role's functions in every
--   schema; instead `migrate` revokes PUBLIC's rights in the schema after every run
--   (privileges.close_to_public), and tests/integration/test_privileges.py fails on any function or table
--   that is not declared.
-- - Retention counts a range's keep from when it closed too (outbox.partitions.closed_at), not only from
--   its newest event's created_at, which is its transaction's start (issue 25, finding 4).
--
-- No min-code-version: relays of version 18 keep working (their calls are kept, with these limits).

ALTER TABLE outbox.housekeeping
    ADD COLUMN default_keep interval NOT NULL DEFAULT interval '604800 seconds'
        CONSTRAINT housekeeping_default_keep_valid CHECK (default_keep >= interval '0');

-- Finding 4 of issue 25: an event's created_at is its transaction's start (now()), so the events of a
-- transaction open for longer than their class's keep went as soon as they were delivered. A range's keep
-- now also counts from when retention first saw it closed (no transaction that could write to it still
-- running: about its last writer's commit). Ranges closed before this migration keep the old rule.
ALTER TABLE outbox.partitions ADD COLUMN closed_at timestamptz;
UPDATE outbox.partitions SET closed_at = '-infinity'
WHERE range_name IS NOT NULL AND NOT outbox.range_open_v1(xid_from, xid_to);

-- The default class keeps at least the stored keep (0019); otherwise as in 0015.
CREATE OR REPLACE FUNCTION outbox.partition_hold_v1(leaf text, default_keep interval) RETURNS text
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    p       outbox.partitions;
    k       record;
    lo      xid8;
    hi      xid8;
    newest  timestamptz;
    who     text;
    relay   text;
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
    -- 0019: the default class keeps what housekeeping stored (the relay's --retention-seconds); a caller
    -- may only ask for longer.
    k := outbox.class_keep_v1(p.class, greatest(default_keep, (SELECT h.default_keep FROM outbox.housekeeping h)));
    IF k.forever THEN
        RETURN format('retention class %s keeps history for good', coalesce(p.class, '(all classes)'));
    END IF;
    IF newest >= clock_timestamp() - k.keep THEN
        RETURN format('within retention (class %s keeps %s; newest event %s)',
                      coalesce(p.class, '(all classes)'), k.keep, newest);
    END IF;
    -- 0019: and from when its range closed (retire_partition_v1 records it): a long transaction's events
    -- carry its start, so they would otherwise go as soon as they are delivered.
    IF p.range_name IS NOT NULL AND k.keep > interval '0' THEN
        IF p.closed_at IS NULL AND outbox.range_open_v1(p.xid_from, p.xid_to) THEN
            RETURN 'still being written';
        ELSIF coalesce(p.closed_at, clock_timestamp()) >= clock_timestamp() - k.keep THEN
            RETURN format('within retention (class %s keeps %s; its range closed %s)', p.class, k.keep,
                          coalesce(p.closed_at::text, 'just now'));
        END IF;
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
    -- 0015: parked events and dead letters no longer hold a partition (retire_partition_v1 keeps a copy of
    -- each), unless a relay older than schema version 15 is alive: it reads a parked event from its partition only.
    SELECT w.id INTO relay FROM outbox.workers w
    WHERE w.status <> 'dead'
      AND CASE WHEN jsonb_typeof(w.metadata -> 'schema_version') = 'number'
               THEN (w.metadata ->> 'schema_version')::numeric < 15 ELSE true END
    ORDER BY w.id LIMIT 1;
    IF relay IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT format('an event of sink %s is parked (key %s) and relay %s is older than schema version 15', q.sink,
                  q.partition_key, relay) INTO who
    FROM outbox.parked q WHERE q.xid >= lo AND q.xid < hi LIMIT 1;
    IF who IS NOT NULL THEN
        RETURN who;
    END IF;
    SELECT format('an event of sink %s is in dead letters and relay %s is older than schema version 15', d.sink,
                  relay) INTO who
    FROM outbox.dead_letters d WHERE d.xid >= lo AND d.xid < hi LIMIT 1;
    RETURN who;
END
$$;

-- Never less than the stored keep (0019); otherwise as in 0015.
CREATE OR REPLACE FUNCTION outbox.retire_partition_v1(default_keep interval,
                                           OUT leaf text, OUT removed bigint, OUT newest timestamptz)
    RETURNS SETOF record
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    p       outbox.partitions;
    bottom  xid8;
    top     xid8;
BEGIN
    -- 0019: never less than what housekeeping stored (a caller may only keep longer).
    default_keep := greatest(default_keep, (SELECT h.default_keep FROM outbox.housekeeping h));
    FOR p IN SELECT * FROM outbox.partitions ORDER BY xid_from NULLS FIRST, name LOOP
        -- Cheap exits first, so that a pass costs little however long history is: ranges from the first
        -- one still being written on are all open; a class kept for good is never looked into.
        IF p.range_name IS NOT NULL AND outbox.range_open_v1(p.xid_from, p.xid_to) THEN
            EXIT;
        END IF;
        -- 0019: when its range was first seen closed (about when the last transaction that wrote to it ended):
        -- retention counts from then too, since an event's created_at is its transaction's start.
        IF p.range_name IS NOT NULL AND p.closed_at IS NULL THEN
            UPDATE outbox.partitions SET closed_at = clock_timestamp() WHERE range_name = p.range_name AND closed_at IS NULL;
            p.closed_at := clock_timestamp();
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
        -- 0015: its parked and dead-lettered events stay, as copies, for their retries (the relay reads a
        -- parked event from its copy once the partition is gone).
        EXECUTE format('INSERT INTO outbox.kept_events (id, xid, seq, partition_key, bucket, topic, type, payload, '
                       'headers, idempotency_key, created_at, occurred_at, schema_version) '
                       'SELECT e.id, e.xid, e.seq, e.partition_key, e.bucket, e.topic, e.type, e.payload, e.headers, '
                       'e.idempotency_key, e.created_at, e.occurred_at, e.schema_version FROM outbox.%I e '
                       'WHERE (e.bucket, e.xid, e.seq) IN ('
                       'SELECT q.bucket, q.xid, q.seq FROM outbox.parked q WHERE q.xid >= $1 AND q.xid <= $2 '
                       'UNION SELECT d.bucket, d.xid, d.seq FROM outbox.dead_letters d WHERE d.xid >= $1 AND d.xid <= $2) '
                       'ON CONFLICT DO NOTHING', p.name)
            USING bottom, top;
        -- Its events' keys: those of its xid range (index idempotency_keys_xid) whose event it holds, but
        -- not of an event kept (its key goes with the copy: release_kept_events_v1).
        EXECUTE format('DELETE FROM outbox.idempotency_keys k WHERE k.xid >= $1 AND k.xid <= $2 '
                       'AND EXISTS (SELECT FROM outbox.%I e WHERE e.id = k.event_id AND e.xid = k.xid) '
                       'AND NOT EXISTS (SELECT FROM outbox.kept_events c WHERE c.id = k.event_id AND c.xid = k.xid)',
                       p.name)
            USING bottom, top;
        IF removed > 0 THEN
            -- The total over all classes (read by relays of version 14) ...
            UPDATE outbox.history
            SET removed_through = greatest(removed_through, newest), removed_xid = greatest(removed_xid, top),
                removed_events = removed_events + removed, removed_at = clock_timestamp();
            -- ... and per class and topics (0015): a class's leaf held its topics; a DEFAULT leaf every topic
            -- but those of its range's other leaves (those still listed: one dropped earlier is not, which
            -- only makes the row cover more); a mixed leaf every topic.
            INSERT INTO outbox.history_removed AS r (class, topics, except_topics, removed_through, removed_xid,
                                                     removed_events, removed_at)
            VALUES (coalesce(p.class, '(all)'),
                    CASE WHEN p.class <> 'default' THEN p.topics END,
                    CASE WHEN p.class = 'default'
                         THEN coalesce((SELECT array_agg(DISTINCT t ORDER BY t)
                                        FROM outbox.partitions s CROSS JOIN unnest(s.topics) AS t
                                        WHERE s.range_name = p.range_name AND s.name <> p.name), '{}')
                         ELSE '{}' END,
                    newest, top, removed, clock_timestamp())
            ON CONFLICT (class, (coalesce(topics, '{}'::text[])), except_topics) DO UPDATE
            SET removed_through = greatest(r.removed_through, EXCLUDED.removed_through),
                removed_xid = greatest(r.removed_xid, EXCLUDED.removed_xid),
                removed_events = r.removed_events + EXCLUDED.removed_events, removed_at = EXCLUDED.removed_at;
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

-- Leaves only (0019).
CREATE OR REPLACE FUNCTION outbox.partition_oldest_v1(leaf text) RETURNS timestamptz
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    oldest timestamptz;
BEGIN
    -- 0019: a leaf of outbox.events only, not any table the caller names.
    IF NOT EXISTS (SELECT FROM outbox.partitions p WHERE p.name = leaf) THEN
        RETURN NULL;
    END IF;
    EXECUTE format('SELECT min(created_at) FROM outbox.%I', leaf) INTO oldest;
    RETURN oldest;
END
$$;

-- As the schema's owner, recording the key itself (0019); otherwise as in 0018.
CREATE OR REPLACE FUNCTION outbox.check_event_v4() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
    -- 0018: what Python (and so the relays and most consumers) can hold in every time zone; 'infinity',
    -- BC and year 10000 are stored by PostgreSQL, then no read of the event's bucket succeeds.
    IF NEW.occurred_at NOT BETWEEN timestamptz '0001-01-02 00:00:00+00' AND timestamptz '9999-12-30 23:59:59.999999+00' THEN
        RAISE EXCEPTION 'outbox.events.occurred_at % is outside 0001-01-02 to 9999-12-30 UTC', NEW.occurred_at
            USING ERRCODE = 'check_violation', HINT = 'leave occurred_at NULL for an event without a time of its own';
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
        -- Waits for a concurrent transaction holding the same key; skips the row once it committed. 0019:
        -- here, as the schema's owner, for the row being inserted (no function takes a key from a caller).
        INSERT INTO outbox.idempotency_keys AS k (scope, key, event_id, fingerprint, xid)
        VALUES (coalesce(NEW.topic, ''), NEW.idempotency_key, NEW.id, NEW.idempotency_fingerprint, NEW.xid)
        ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO NOTHING;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
    ELSE
        NEW.idempotency_fingerprint := NULL;
    END IF;
    RETURN NEW;
END
$$;

DROP FUNCTION outbox.claim_idempotency_key_v1(text, text, uuid, bytea, xid8);

-- Retire the oldest leaf that may go, by the stored keep and the classes: the relays' call (0019).
CREATE FUNCTION outbox.retire_partition_v2(OUT leaf text, OUT removed bigint, OUT newest timestamptz)
    RETURNS SETOF record
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN QUERY SELECT r.leaf, r.removed, r.newest FROM outbox.retire_partition_v1(NULL) r;
END
$$;

-- Nothing open to PUBLIC (migrate repeats this after every run: privileges.close_to_public).
REVOKE ALL ON SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox FROM PUBLIC;

-- EXECUTE by role kind (outbox_relay/privileges.py at schema version 19).
DO $$
DECLARE
    who     text;
    kind    text;
    fns     text[];
    fn      text;
BEGIN
    -- Every explicit grant goes first.
    FOR who IN
        SELECT DISTINCT quote_ident(pg_get_userbyid(a.grantee))
        FROM pg_proc p CROSS JOIN LATERAL aclexplode(p.proacl) a
        WHERE p.pronamespace = 'outbox'::regnamespace AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox FROM %s', who);
    END LOOP;
    FOR who, kind IN
        WITH relays AS (
            SELECT a.grantee FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
            WHERE c.oid = 'outbox.housekeeping'::regclass AND a.privilege_type = 'UPDATE'
        ),
        projectors AS (
            SELECT a.grantee FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
            WHERE c.oid = 'outbox.cursors'::regclass AND a.privilege_type = 'INSERT'
            EXCEPT SELECT r.grantee FROM relays r
        ),
        producers AS (
            (SELECT a.grantee FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
             WHERE c.oid = 'outbox.events'::regclass AND a.privilege_type = 'INSERT'
             UNION
             SELECT a.grantee FROM pg_attribute t CROSS JOIN LATERAL aclexplode(t.attacl) a
             WHERE t.attrelid = 'outbox.events'::regclass AND t.attname = 'idempotency_key'
               AND a.privilege_type = 'INSERT')
            EXCEPT SELECT r.grantee FROM relays r
            EXCEPT SELECT j.grantee FROM projectors j
        )
        SELECT quote_ident(pg_get_userbyid(k.grantee)), k.kind
        FROM (SELECT r.grantee, 'relay' AS kind FROM relays r
              UNION SELECT j.grantee, 'projector' FROM projectors j
              UNION SELECT d.grantee, 'producer' FROM producers d) k
        WHERE k.grantee <> 0 AND k.grantee <> (SELECT nspowner FROM pg_namespace WHERE nspname = 'outbox')
    LOOP
        fns := CASE kind
            WHEN 'producer' THEN ARRAY['bucket_v1(text)', 'fingerprint_v1(text, text, jsonb)']
            ELSE ARRAY['bucket_v1(text)', 'delivered_v1(xid8, bigint, pg_snapshot, pg_snapshot, xid8, bigint)',
                       'bucket_has_work_v2(text, integer, pg_snapshot, pg_snapshot, xid8, bigint)',
                       'bucket_has_work_v3(text, integer, pg_snapshot, pg_snapshot, xid8, bigint)',
                       'watch_commits_v1(pg_snapshot, integer, double precision)',
                       'history_covers_v1(text[], text[], text[])', 'history_stored_from_v1(text[])']
        END;
        IF kind = 'relay' THEN
            fns := fns || ARRAY['add_partition_v1(bigint, double precision)',
                                'roll_partition_v1(bigint, double precision)', 'retire_partition_v1(interval)',
                                'retire_partition_v2()', 'release_kept_events_v1()',
                                'partition_hold_v1(text, interval)', 'partition_oldest_v1(text)',
                                'class_keep_v1(text, interval)'];
        ELSIF kind = 'projector' THEN
            fns := fns || ARRAY['projection_batch_guard_v1()', 'projection_batch_end_v1(text)'];
        END IF;
        FOREACH fn IN ARRAY fns LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION outbox.%s TO %s', fn, who);
        END LOOP;
    END LOOP;
END
$$;
