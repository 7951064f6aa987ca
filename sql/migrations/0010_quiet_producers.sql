-- 0010_quiet_producers: a producer's INSERT costs what a plain INSERT costs.
--
-- Until now every insert statement fired a statement trigger that sent NOTIFY outbox_events_v2 with
-- the buckets it wrote. PostgreSQL serialises the commits of all transactions that notified (a
-- server-wide lock from the notifying commit's pre-commit through its WAL flush), and a transaction
-- that notified can not PREPARE TRANSACTION. Producers now notify nobody:
--
-- - The trigger and its function go. Relays are woken instead by one relay per deployment (the one
--   holding the wake-up advisory lock on its LISTEN connection, outbox_relay/wakeups.py), which calls
--   outbox.watch_commits_v1 in a loop. The function sleeps in the server and returns as soon as a
--   transaction that wrote events has committed, with the buckets it wrote, after sending the same
--   NOTIFY outbox_events_v2 the trigger used to send (so relays of the previous version wake too, once
--   a relay of this version runs). Only that relay's transaction notifies.
-- - It finds new commits the way a relay reads (PgQ's batches): events whose transaction is not
--   visible in the snapshot of its previous look. events_xid makes that one short index range (the
--   transactions that started since) plus a probe per transaction that was open then.
-- - The row trigger that refuses what no relay could deliver (check_event_v1, unchanged) runs only
--   for rows that need it: an idempotency key to fingerprint, headers to check, a producer-set xid or
--   created_at, or an invalid topic. A plain event is checked by the trigger's WHEN clause alone, in
--   the executor, without entering PL/pgSQL (the call cost about 75 us per row).
--
-- Relays of the previous version keep working against this schema (no min-code-version): they are
-- woken by a relay of this version, and poll (--listen-poll-seconds) while none runs, so roll out the
-- new relays right after migrating.

DROP TRIGGER events_notify ON outbox.events;
DROP FUNCTION outbox.notify_events_v2();

DROP TRIGGER events_check ON outbox.events;
CREATE TRIGGER events_check BEFORE INSERT ON outbox.events
    FOR EACH ROW
    WHEN (NEW.idempotency_key IS NOT NULL
          OR NEW.headers <> '{}'::jsonb
          OR NEW.xid IS DISTINCT FROM pg_current_xact_id()
          OR NEW.created_at IS DISTINCT FROM now()
          OR NEW.topic !~ '^[A-Za-z0-9._-]{1,249}$' OR NEW.topic IN ('.', '..'))
    EXECUTE FUNCTION outbox.check_event_v1();

-- Commits since a snapshot (watch_commits_v1): one range from its xmax, one probe per open id.
CREATE INDEX events_xid ON outbox.events (xid);

-- Wait until events committed that `since` did not see, at most wait_ms, looking every interval_ms.
-- Returns the snapshot of the last look and the buckets written (comma-separated, or '*' when more
-- than 10,000 events arrived at once: every relay then reads all it holds), NULL if nothing came.
-- It notifies outbox_events_v2 with the same payload. since NULL: returns the current snapshot at once.
CREATE FUNCTION outbox.watch_commits_v1(since pg_snapshot, wait_ms integer, interval_ms double precision,
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
        FROM ((SELECT e.bucket FROM outbox.events e WHERE e.xid >= later ORDER BY e.xid LIMIT 10001)
              UNION ALL
              (SELECT e.bucket FROM outbox.events e WHERE e.xid = ANY (open_ids) ORDER BY e.xid LIMIT 10001)) n;
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
