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
-- - The row trigger that refuses what no relay could deliver (now check_event_v2) runs only
--   for rows that need it: an idempotency key to fingerprint, headers to check, a producer-set xid or
--   created_at, or an invalid topic. A plain event is checked by the trigger's WHEN clause alone, in
--   the executor, without entering PL/pgSQL (the call cost about 75 us per row).
-- - Reserved header names are compared with lookalikes folded (header_name_key_v1): CE-ID, "ce_id ",
--   fullwidth letters or a zero-width space no longer pass for a name of the relay's own.
--
-- Relays of the previous version keep working against this schema (no min-code-version): they are
-- woken by a relay of this version, and poll (--listen-poll-seconds) while none runs, so roll out the
-- new relays right after migrating.

DROP TRIGGER events_notify ON outbox.events;
DROP FUNCTION outbox.notify_events_v2();

-- A header name as the reserved-name check compares it (0010): NFKC-normalised (fullwidth letters
-- become ASCII), without whitespace and invisible format characters, lower case, '-' read as '_'.
-- outbox_relay/event.py header_name_key is the same rule (and refuses at least what this refuses).
CREATE FUNCTION outbox.header_name_key_v1(name text) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE STRICT
    RETURN replace(lower(regexp_replace(
        CASE WHEN current_setting('server_encoding') = 'UTF8' THEN normalize(name, NFKC) ELSE name END,
        '[[:space:]\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0]',
        '', 'g')), '-', '_');

-- Refuse an event the relays could not position, keep, or deliver; header names are compared with
-- lookalikes folded (header_name_key_v1); otherwise check_event_v1 of 0005, which goes.
CREATE FUNCTION outbox.check_event_v2() RETURNS trigger
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
    NEW.idempotency_fingerprint := CASE WHEN NEW.idempotency_key IS NOT NULL
                                        THEN outbox.fingerprint_v1(NEW.type, NEW.partition_key, NEW.payload) END;
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
    RETURN NEW;
END
$$;

DROP TRIGGER events_check ON outbox.events;
CREATE TRIGGER events_check BEFORE INSERT ON outbox.events
    FOR EACH ROW
    WHEN (NEW.idempotency_key IS NOT NULL
          OR NEW.headers <> '{}'::jsonb
          OR NEW.xid IS DISTINCT FROM pg_current_xact_id()
          OR NEW.created_at IS DISTINCT FROM now()
          OR NEW.topic !~ '^[A-Za-z0-9._-]{1,249}$' OR NEW.topic IN ('.', '..'))
    EXECUTE FUNCTION outbox.check_event_v2();
DROP FUNCTION outbox.check_event_v1();

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
