-- 0005_hardening: the database owns what the relays rely on; idempotency keys per topic; one
-- housekeeper per interval; schema versions that say which code may run against them.
-- min-code-version: 5
--
-- Why each part (issue 7):
-- - An event's position is its transaction id (xid) and retention counts from created_at. A
--   producer that writes either (a hand-written INSERT, an ORM that fills every column) could put
--   an event behind every cursor, where no relay ever reads it, or stamp it 1970 so that retention
--   deletes it, and forgets its idempotency key, right after delivery. The trigger below refuses
--   both. A producer's own notion of time goes to occurred_at (the ce_time header).
-- - Headers the relay can not send (values that are not strings) wedged a sink, and headers named
--   like the relay's own (ce_id, outbox_fence, ...) reached consumers twice. Refused at insert.
--   A trigger rather than CHECK constraints: the checks are cheaper in one PL/pgSQL function
--   (about 2 us per row) and a dump restores (triggers are created after the data is loaded).
-- - Idempotency keys were global: one service could pre-claim another's key and swallow its event.
--   They are now scoped per topic.
-- - `sinks drop` of a sink a relay still ran made the relay idle silently, and re-register it from
--   the start of history later. Dropped sinks now leave a tombstone.
-- - Housekeeping took an advisory lock that any role can hold, silently stopping lease expiry and
--   retention, and every relay ran it. A claim row that only relay roles can update elects one
--   housekeeper per interval, cluster-wide, and shows when it last ran.

-- Code written for an older schema refuses a database whose migrations need newer code.
ALTER TABLE outbox.schema_migrations ADD COLUMN min_code_version integer;

-- The time the producer says the event happened (ce_time); NULL: when it was stored (created_at).
ALTER TABLE outbox.events ADD COLUMN occurred_at timestamptz;
-- What an idempotency key stands for (type, key and payload), so that a reuse with other content is
-- told apart from a retry without giving producers the right to read other services' payloads.
ALTER TABLE outbox.events ADD COLUMN idempotency_fingerprint bytea;

-- What an idempotency key stands for: the event's type, key and payload (jsonb text is canonical).
CREATE FUNCTION outbox.fingerprint_v1(type text, partition_key text, payload jsonb) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
    -- Length-prefixed, so that no two (type, key) pairs run together into the same text.
    RETURN sha256(convert_to(length(type) || ':' || type || length(partition_key) || ':' || partition_key
                             || payload::text, 'UTF8'));

-- Refuse an event the relays could not position, keep, or deliver (messages name the column), and
-- fingerprint idempotent ones.
CREATE FUNCTION outbox.check_event_v1() RETURNS trigger
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
            IF lower(name) IN ('ce_specversion', 'ce_id', 'ce_source', 'ce_type', 'ce_time', 'ce_sequence',
                               'ce_partitionkey', 'content-type')
               OR lower(name) LIKE 'outbox\_%' THEN
                RAISE EXCEPTION 'outbox.events.headers: % is reserved for the relay', quote_literal(name)
                    USING ERRCODE = 'check_violation';
            END IF;
        END LOOP;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER events_check BEFORE INSERT ON outbox.events
    FOR EACH ROW EXECUTE FUNCTION outbox.check_event_v1();

-- Producer idempotency per topic (events without a topic share one scope).
DROP INDEX outbox.events_idempotency_key;
CREATE UNIQUE INDEX events_idempotency_key ON outbox.events ((coalesce(topic, '')), idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- A dropped sink leaves a tombstone: a relay that still runs it stops instead of registering it
-- again from the oldest retained event (which would apply that history a second time). Its
-- cursors, parked events and dead letters are deleted by the drop; only the row stays.
ALTER TABLE outbox.sinks ADD COLUMN dropped_at timestamptz;

-- One row: who runs housekeeping now and when it last finished. A relay claims a pass with one
-- UPDATE (the interval has passed since the last one finished, or a claimed pass went stale), so
-- one relay per interval does the work, and any relay can see when housekeeping last ran.
CREATE TABLE outbox.housekeeping (
    singleton   boolean     NOT NULL DEFAULT true CONSTRAINT housekeeping_singleton CHECK (singleton),
    run_by      text,
    started_at  timestamptz NOT NULL DEFAULT '-infinity',
    finished_at timestamptz NOT NULL DEFAULT '-infinity',
    CONSTRAINT housekeeping_pkey PRIMARY KEY (singleton)
);
INSERT INTO outbox.housekeeping DEFAULT VALUES;
