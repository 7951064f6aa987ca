-- 0015_history_per_class: history watermarks per retention class, and dead letters that do not pin
-- partitions (docs/history.md).
--
-- - The rebuild watermark (0011, outbox.history) was global: dropping a partition of a short-kept class
--   made the rebuild of a projection that reads only a class kept for good refuse. Now retention records
--   what it removed per class and per the topics the removed partitions held (outbox.history_removed):
--   a class's leaf holds its LIST topics; a range's DEFAULT leaf every topic but those its range gave to
--   other classes; events_legacy and events_default every topic (class '(all)'). A projection's rebuild
--   checks the rows that cover the topics it reads (outbox.history_covers_v1) and were removed after its
--   history began (sinks.history_since). So a topic moved to another class mid-history still counts
--   what left with the class it was in then.
-- - Sinks record the topics they read (sinks.topics, NULL: all; written when a relay registers the sink),
--   so that `status` shows per projection how far back a rebuild goes.
-- - A parked or dead-lettered event held its whole partition. Now retire_partition_v1 copies such events
--   into outbox.kept_events before it drops their partition, and the relay reads a parked event from its
--   copy when the partition is gone, so `dead-letters retry` works as before. A copy (and the event's
--   idempotency key: it lives as long as the event is stored) goes once no parked row or dead letter
--   names the event (release_kept_events_v1, each housekeeping pass). Relays older than this version read
--   a parked event from its partition only: while one is alive, parked events and dead letters hold
--   their partitions as before.
-- - outbox.history stays the total over all classes (relays of version 14 read it).
--
-- No min-code-version: relays of version 14 keep running (see above).

-- What retention removed, per retention class and the topics of the partitions it removed.
CREATE TABLE outbox.history_removed (
    -- The removed leaves' class; '(all)': events_legacy or events_default, which hold every topic.
    class           text        NOT NULL,
    -- The topics they held (a class's LIST values, sorted); NULL: every topic except except_topics.
    topics          text[],
    -- A range's DEFAULT leaf: the topics its range gave to other classes (as far as still known when it went).
    except_topics   text[]      NOT NULL DEFAULT '{}',
    -- The newest removed event (created_at) and the largest removed transaction id, how many in all.
    removed_through timestamptz NOT NULL,
    removed_xid     xid8        NOT NULL,
    removed_events  bigint      NOT NULL DEFAULT 0,
    -- The last removal: a sink whose history began before it had applied what went.
    removed_at      timestamptz NOT NULL
);
CREATE UNIQUE INDEX history_removed_scope ON outbox.history_removed (class, (coalesce(topics, '{}'::text[])), except_topics);
-- The global watermark so far: which topics it removed is not known, so it counts for every topic.
INSERT INTO outbox.history_removed (class, topics, removed_through, removed_xid, removed_events, removed_at)
SELECT '(all)', NULL, h.removed_through, coalesce(h.removed_xid, '0'::xid8), h.removed_events,
       coalesce(h.removed_at, clock_timestamp())
FROM outbox.history h WHERE h.removed_through IS NOT NULL;

-- Whether removed history (a row of outbox.history_removed: its topics and except_topics) may hold
-- events of the topics a sink reads (reads NULL: every topic, and events without one).
CREATE FUNCTION outbox.history_covers_v1(topics text[], except_topics text[], reads text[]) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN reads IS NULL
        OR CASE WHEN topics IS NOT NULL THEN topics && reads ELSE NOT (reads <@ except_topics) END;

-- From when events of the topics a sink reads (NULL: all) are stored: the oldest event of the leaves that
-- may hold them (one index probe per leaf, not a scan for the topics: a leaf that holds other topics too,
-- a default or mixed one, may make this earlier than their oldest event). NULL: none is stored. As the
-- schema's owner, like partition_oldest_v1 (projectors may not read outbox.partitions).
CREATE FUNCTION outbox.history_stored_from_v1(reads text[]) RETURNS timestamptz
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    RETURN (SELECT min(outbox.partition_oldest_v1(p.name))
            FROM outbox.partitions p
            WHERE p.class IS NULL
               OR outbox.history_covers_v1(
                      CASE WHEN p.class <> 'default' THEN p.topics END,
                      CASE WHEN p.class = 'default'
                           THEN coalesce((SELECT array_agg(t) FROM outbox.partitions s CROSS JOIN unnest(s.topics) AS t
                                          WHERE s.range_name = p.range_name AND s.name <> p.name), '{}')
                           ELSE '{}' END,
                      reads));

-- The topics a sink reads (NULL: all), and when its history began: retention that removes events of its
-- topics after that removed events it applied. Sinks already incomplete by the global watermark stay so.
ALTER TABLE outbox.sinks ADD COLUMN topics text[];
ALTER TABLE outbox.sinks ADD COLUMN history_since timestamptz NOT NULL DEFAULT clock_timestamp();
UPDATE outbox.sinks s SET history_since = '-infinity'
FROM outbox.history h
WHERE h.removed_through IS NOT NULL AND (s.history_from IS NULL OR h.removed_through > s.history_from);

-- Parked and dead-lettered events whose partition retention dropped: what a retry delivers.
CREATE TABLE outbox.kept_events (
    id              uuid        NOT NULL,
    xid             xid8        NOT NULL,
    seq             bigint      NOT NULL,
    partition_key   text        NOT NULL,
    bucket          integer     NOT NULL,
    topic           text,
    type            text        NOT NULL,
    payload         jsonb       NOT NULL,
    headers         jsonb       NOT NULL,
    idempotency_key text,
    created_at      timestamptz NOT NULL,
    occurred_at     timestamptz,
    schema_version  integer     NOT NULL,
    kept_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT kept_events_pkey PRIMARY KEY (bucket, xid, seq)
);
-- By event id: wait_for, and the idempotency keys of kept events.
CREATE INDEX kept_events_id ON outbox.kept_events (id);

-- Copies no parked row or dead letter names any more go, with their events' idempotency keys (the
-- partition that held the event is gone). Returns how many. As the schema's owner: relays run it with
-- EXECUTE alone. Every way a parked row or dead letter of a dropped partition's event appears moves one
-- that exists (retry, skip, give up, a rebuild's switch), in one statement: this never takes a copy
-- that is still needed.
CREATE FUNCTION outbox.release_kept_events_v1() RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n bigint;
BEGIN
    WITH gone AS (
        DELETE FROM outbox.kept_events c
        WHERE NOT EXISTS (SELECT FROM outbox.parked q WHERE q.bucket = c.bucket AND q.xid = c.xid AND q.seq = c.seq)
          AND NOT EXISTS (SELECT FROM outbox.dead_letters d
                          WHERE d.bucket = c.bucket AND d.xid = c.xid AND d.seq = c.seq)
        RETURNING c.id, c.xid
    ),
    keys AS (
        DELETE FROM outbox.idempotency_keys k USING gone g WHERE k.event_id = g.id AND k.xid = g.xid
    )
    SELECT count(*) INTO n FROM gone;
    RETURN n;
END
$$;

-- What keeps a leaf of outbox.events from being removed now, in words (NULL: nothing). As in 0014, but a
-- parked event or a dead letter in its range holds it only while a relay older than this version runs.
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

-- Remove the oldest leaf that nothing holds, as in 0014; its parked and dead-lettered events are kept as
-- copies first, and the watermark moves per class and topics too.
CREATE OR REPLACE FUNCTION outbox.retire_partition_v1(default_keep interval,
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
