-- 0018_occurred_at_range: SQL producers' occurred_at gets the refusal publish() gives.
--
-- PostgreSQL stores a timestamptz of 'infinity', of a BC year or of year 10000 and later; no relay can
-- read one back (psycopg, Python's datetime, and most consumers' clients hold years 1-9999 in every time
-- zone), so every read of its bucket failed and every key of the bucket waited for good. publish()
-- refuses a time outside 0001-01-02..9999-12-30 UTC; the events_check trigger now refuses the same for
-- an INSERT in SQL (check_event_v4; the trigger's WHEN tests the range, so a plain INSERT with a time in
-- it, or none, still runs no PL/pgSQL). Rows stored before this migration are not checked.
--
-- No min-code-version: relays do not call the trigger function.

CREATE FUNCTION outbox.check_event_v4() RETURNS trigger
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

DROP TRIGGER events_check ON outbox.events;
CREATE TRIGGER events_check BEFORE INSERT ON outbox.events
    FOR EACH ROW
    WHEN (NEW.idempotency_key IS NOT NULL
          OR NEW.headers <> '{}'::jsonb
          OR NEW.xid IS DISTINCT FROM pg_current_xact_id()
          OR NEW.created_at IS DISTINCT FROM now()
          OR NEW.topic !~ '^[A-Za-z0-9._-]{1,249}$' OR NEW.topic IN ('.', '..')
          OR NEW.occurred_at NOT BETWEEN timestamptz '0001-01-02 00:00:00+00' AND timestamptz '9999-12-30 23:59:59.999999+00')
    EXECUTE FUNCTION outbox.check_event_v4();

DROP FUNCTION outbox.check_event_v3();
