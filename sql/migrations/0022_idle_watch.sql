-- 0022_idle_watch: an idle commit watcher costs its server a snapshot per look, not two index scans.
--
-- outbox.watch_commits_v1 looks every interval_ms (1 ms while commits come; the relay now doubles the
-- interval of each call that found nothing, up to --watch-max-interval-ms, outbox_relay/wakeups.py).
-- A look on an idle server ran the whole statement (a snapshot, two index scans of events_xid over
-- the current partitions) to find nothing. It now compares the server's snapshot with the one of its
-- last look first: while they are equal no transaction with an id has ended, so none can have
-- committed events, and the scans are skipped. The function's arguments and results are unchanged
-- (it is replaced in place, as 0014 did, so relays of the previous version use it as before).
-- Measured: bench/results/2026-12-02-idle.md.

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
        -- 0022: while the server's snapshot is the one of the last look, no transaction with an id has
        -- ended since (a commit moves xmax or leaves xip), so nothing can have committed events: the
        -- scans are skipped and an idle look is this comparison alone.
        IF pg_current_snapshot()::text <> since::text THEN
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
            since := snapshot;
        END IF;
        EXIT WHEN clock_timestamp() >= deadline;
        PERFORM pg_sleep(interval_ms / 1000.0);
    END LOOP;
    snapshot := since;
END
$$;
