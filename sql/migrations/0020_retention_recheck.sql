-- 0020_retention_recheck: retention looks again, under the leaf's lock, whether a sink holds a leaf it is
-- about to remove (it did only for mixed leaves).
--
-- A rebuild's sink holds the history it has still to replay, but only once its registration committed. A
-- removal that had looked before that commit could drop a leaf the rebuild then replayed without, swapping
-- in an incomplete model with `status` saying complete (issue 25). Now every leaf is locked (ACCESS
-- EXCLUSIVE, as its DROP or TRUNCATE would lock it a moment later) before the second look, and a rebuild
-- checks what history exists after its registration committed, behind a read of outbox.events that waits
-- for a removal holding a leaf: a leaf it needs either went before its check (which then refuses) or stays.
--
-- The same signature, so relays of every version call it as before; no min-code-version. The body is 0019's
-- (the stored keep, closed_at) with the lock taken for every leaf.
--
-- Also an index for a rebuild's look-up of the live projection's dead letters by position (G12: a rebuild
-- keeps them, projections/decisions.py).

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
        -- Lock the leaf, then look again (0020): a mixed leaf may still receive events, and a sink registered
        -- since the first look (a rebuild's start) holds any leaf. A rebuild checks what history exists only
        -- once its registration committed and no removal holds a leaf (Rebuild._check_retained), so a leaf it
        -- needs either went before that check, which then sees it gone, or stays.
        EXECUTE format('LOCK TABLE outbox.%I IN ACCESS EXCLUSIVE MODE', p.name);
        IF outbox.partition_hold_v1(p.name, default_keep) IS NOT NULL THEN
            CONTINUE;
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

-- The rebuild's look-up of what the live projection dead-lettered, by a batch's transaction id range
-- (live_decisions in sql/queries/rebuild.sql): a range scan per batch, not a probe per event.
CREATE INDEX dead_letters_sink_position ON outbox.dead_letters (sink, xid, seq);
