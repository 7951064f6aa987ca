-- The current schema snapshot: every object that `outbox-relay migrate` creates, in one file.
--
-- Hand-kept: it equals migrate.BOOTSTRAP (schema and outbox.schema_migrations) plus every
-- migration in sql/migrations/ applied in order. A migration is the change; this file is the
-- result, for reading the schema in one place and for setting up a database in one step.
-- tests/integration/test_migrations.py checks that loading this file and applying all migrations
-- give the same catalog (tables, columns, defaults, indexes, constraints, functions, triggers),
-- and that `migrate` finds nothing to do afterwards. When you add a migration, update this file
-- and the version list at the end.

CREATE SCHEMA outbox;

-- Applied migrations (migrate.BOOTSTRAP).
CREATE TABLE outbox.schema_migrations (
    version    integer     NOT NULL PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- 0005: the oldest code (by the schema version it was written for) that may run against this
    -- schema once this migration is applied; NULL: no constraint.
    min_code_version integer
);

-- 0001_initial: event log, sinks with per-bucket cursors and leases, parked retries,
-- dead letters, worker registry (see sql/migrations/0001_initial.sql for the design paragraph).

-- The one definition of a key's bucket. Producers in any language get it for free
-- because events.bucket is generated from it. hashtextextended is the hash behind hash
-- partitioning, so it is stable across versions and platforms. 256 buckets: fine
-- enough for even spread over dozens of workers, few enough that a fetch probes each
-- owned bucket's index range cheaply.
CREATE FUNCTION outbox.bucket_v1(partition_key text) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
    RETURN (hashtextextended(partition_key, 0) & 255)::integer;

CREATE TABLE outbox.events (
    id              uuid        NOT NULL DEFAULT gen_random_uuid(),
    -- Position: top-level transaction id, then insertion order. Relays read deltas of
    -- snapshot cursors (0007): a key's transactions in the order they became visible,
    -- those that became visible between the same two reads in this order.
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
    -- 0005: the time the producer says the event happened (ce_time); NULL: created_at.
    occurred_at     timestamptz,
    -- 0005: fingerprint_v1(type, partition_key, payload) of an idempotent event (set by events_check).
    idempotency_fingerprint bytea,
    -- 0012: the version of the payload's schema (upcasters turn older ones into the current shape).
    schema_version  integer     NOT NULL DEFAULT 1,
    CONSTRAINT events_schema_version_valid CHECK (schema_version BETWEEN 1 AND 32767)
) PARTITION BY RANGE (xid);  -- 0014: see sql/migrations/0014_partitioned_history.sql and docs/history.md

-- The read path (fetch_events): per held bucket, index probes for the cursor's xip ids that ended
-- and one range from its xmax, in the newest partitions only. Not unique: a unique index on a
-- partitioned table must hold every partition key (seq is an identity: unique anyway).
CREATE INDEX events_position ON outbox.events (bucket, xid, seq);
-- Events by id (replay, progress, explicit ids checked by insert_checked).
CREATE INDEX events_id ON outbox.events (id);
-- Time-based replay and rebuild, and the newest event of a partition (retention).
CREATE INDEX events_created_at ON outbox.events (created_at);
-- Commits since a snapshot (0010, outbox.watch_commits_v1): one range from its xmax, one probe per open id.
-- 0017: and (seq + 0), the order within a transaction, for a rebuild's bulk phase (bulk_read) only: an
-- expression, so that queries ordering one bucket's events by (xid, seq) keep events_position.
CREATE INDEX events_xid ON outbox.events (xid, (seq + 0));

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
    CONSTRAINT partitions_pkey PRIMARY KEY (name),
    -- 0019: when retention first saw its range closed (NULL: not yet; '-infinity': closed before 0019).
    -- Its keep counts from the later of this and its newest event (created_at: the transaction's start).
    closed_at   timestamptz
);

CREATE TABLE outbox.events_default PARTITION OF outbox.events DEFAULT;
INSERT INTO outbox.partitions (name) VALUES ('events_default');

CREATE TABLE outbox.workers (
    id           text        NOT NULL,
    status       text        NOT NULL DEFAULT 'alive'
                 CONSTRAINT workers_status_valid CHECK (status IN ('alive', 'draining', 'dead')),
    sinks        text[]      NOT NULL DEFAULT '{}',
    started_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_seen_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    metadata     jsonb       NOT NULL DEFAULT '{}'::jsonb,
    CONSTRAINT workers_pkey PRIMARY KEY (id)
);

CREATE TABLE outbox.sinks (
    name       text        NOT NULL
               CONSTRAINT sinks_name_valid CHECK (name ~ '^[a-z0-9][a-z0-9_.:-]{0,62}$'),
    -- 0013: any short kind (a user's own sink registers under its own kind).
    kind       text        NOT NULL CONSTRAINT sinks_kind_valid CHECK (kind ~ '^[a-z][a-z0-9_]{0,31}$'),
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- 0005: set by `sinks drop` (a tombstone: relays refuse to register the sink again).
    dropped_at timestamptz,
    -- 0011: outbox.history.removed_through when this sink's history began (registered, or its model
    -- replaced by a rebuild's); NULL: before retention removed anything.
    history_from timestamptz,
    -- 0015: the topics it reads (NULL: all), as its relays last registered it.
    topics       text[],
    -- 0015: when its history began (registered, or its model replaced by a rebuild's): retention that
    -- removes events of its topics after that removed events it applied (outbox.history_removed).
    history_since timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT sinks_pkey PRIMARY KEY (name)
);

-- One row per (sink, bucket): what it delivered there plus the lease on the bucket.
-- Updated by a projection's every batch and a Kafka sink's at most every cursor_flush_seconds (relay.advance),
-- so keep it HOT-friendly: no index on mutable columns.
CREATE TABLE outbox.cursors (
    sink             text        NOT NULL,
    bucket           integer     NOT NULL CONSTRAINT cursors_bucket_valid CHECK (bucket >= 0 AND bucket < 256),
    owner            text,
    -- Fencing token: bumped on every acquisition; every state change names it.
    fence            bigint      NOT NULL DEFAULT 0,
    lease_expires_at timestamptz,
    -- Leases lost (expired, or freed from a dead owner) while the bucket had work
    -- (bucket_has_work_v3); reset once the bucket delivers normal batches again. Drives crash-loop
    -- isolation of a poison event (max_lapses: its events are then probed one at a time).
    lapses           integer     NOT NULL DEFAULT 0,
    advanced_at      timestamptz,
    -- 0007: what was delivered (positions.Cursor): every event of a transaction visible in snapshot,
    -- and while a delta is read in pages, those of target's delta up to (after_xid, after_seq).
    snapshot         pg_snapshot NOT NULL DEFAULT '1:1:',
    target           pg_snapshot,
    after_xid        xid8,
    after_seq        bigint,
    -- 0021: the operator action that last bumped fence while the owner kept its lease (its log says so).
    fenced_by        text,
    CONSTRAINT cursors_pkey PRIMARY KEY (sink, bucket),
    CONSTRAINT cursors_sink_fkey FOREIGN KEY (sink) REFERENCES outbox.sinks (name) ON DELETE CASCADE
) WITH (fillfactor = 50);

-- Retention: the cursors of an event's bucket over all sinks (0004). bucket never changes, so
-- the cursors' updates stay HOT.
COMMENT ON COLUMN outbox.cursors.fenced_by IS
    'the operator action that last bumped fence while the owner kept its lease (keys skip, a rebuild''s '
    'switch-over); cleared when a relay acquires the lease';

CREATE INDEX cursors_bucket ON outbox.cursors (bucket);

-- Events of keys whose head failed: the head waits for its retry, the events behind
-- it wait for the head. Everything else in the bucket flows past.
CREATE TABLE outbox.parked (
    sink          text        NOT NULL,
    bucket        integer     NOT NULL,
    xid           xid8        NOT NULL,
    seq           bigint      NOT NULL,
    partition_key text        NOT NULL,
    event_id      uuid        NOT NULL,
    attempts      integer     NOT NULL DEFAULT 0,
    available_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_error    text,
    parked_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- 0009: chain order. A key's parked events are retried in the order they were parked (the order
    -- the relay delivered them in, which since 0007 is not always (xid, seq)); the head is the first.
    place         bigint      GENERATED BY DEFAULT AS IDENTITY,
    CONSTRAINT parked_pkey PRIMARY KEY (sink, bucket, xid, seq),
    CONSTRAINT parked_sink_fkey FOREIGN KEY (sink) REFERENCES outbox.sinks (name) ON DELETE CASCADE
);

-- Heads per key in chain order (0009).
CREATE INDEX parked_key ON outbox.parked (sink, bucket, partition_key, place);
-- Retention: is an event parked by any sink (0004).
CREATE INDEX parked_position ON outbox.parked (bucket, xid, seq);

CREATE TABLE outbox.dead_letters (
    sink          text        NOT NULL,
    event_id      uuid        NOT NULL,
    bucket        integer     NOT NULL,
    xid           xid8        NOT NULL,
    seq           bigint      NOT NULL,
    partition_key text        NOT NULL,
    attempts      integer     NOT NULL,
    last_error    text        NOT NULL,
    dead_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT dead_letters_pkey PRIMARY KEY (sink, event_id),
    CONSTRAINT dead_letters_sink_fkey FOREIGN KEY (sink) REFERENCES outbox.sinks (name) ON DELETE CASCADE
);

CREATE INDEX dead_letters_key ON outbox.dead_letters (sink, partition_key);
-- 0020: a rebuild's look-up of the live projection's dead letters by a batch's transaction id range.
CREATE INDEX dead_letters_sink_position ON outbox.dead_letters (sink, xid, seq);
CREATE INDEX dead_letters_position ON outbox.dead_letters (bucket, xid, seq);

-- 0008_paused_keys: keys an operator holds for one sink (outbox-relay keys pause); the relay parks
-- their events and retries none of them until resumed (see the migration). bucket_has_work_v2 and v3 below
-- ignore their parked events (their bodies name this table, so it comes first).
CREATE TABLE outbox.paused_keys (
    sink          text        NOT NULL,
    partition_key text        NOT NULL,
    -- The relay looks pauses up per leased bucket (fetch_events in sql/queries/relay.sql).
    bucket        integer     NOT NULL GENERATED ALWAYS AS (outbox.bucket_v1(partition_key)) STORED,
    paused_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Who asked: what the command was told or found (user@host), and the database role it ran as.
    paused_by     text        NOT NULL,
    paused_role   text        NOT NULL DEFAULT session_user,
    reason        text,
    CONSTRAINT paused_keys_pkey PRIMARY KEY (sink, partition_key),
    CONSTRAINT paused_keys_sink_fkey FOREIGN KEY (sink) REFERENCES outbox.sinks (name) ON DELETE CASCADE
);

CREATE INDEX paused_keys_bucket ON outbox.paused_keys (sink, bucket);

-- 0002_crash_isolation, 0007_snapshot_cursors: a lease lapse counts only when the bucket had work.
-- Whether a sink's cursor has delivered an event (positions.Cursor.delivered).
CREATE FUNCTION outbox.delivered_v1(xid xid8, seq bigint, snapshot pg_snapshot, target pg_snapshot,
                                    after_xid xid8, after_seq bigint)
    RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN pg_visible_in_snapshot(xid, snapshot)
        OR (target IS NOT NULL AND pg_visible_in_snapshot(xid, target) AND (xid, seq) <= (after_xid, after_seq));

-- Whether a bucket of a sink has something deliverable now (a lease lapse counts only then): a
-- committed event its cursor has not delivered, or a parked event whose retry is due (0008: of a key
-- that is not paused). The two probes are the two halves of a delta: transactions open at the
-- cursor's snapshot, and later ones.
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

-- 0016: the same answer, with the events probe planned per call for the partitions from the snapshot's
-- xmin on only (v2's plan covered every xid range: a lock per partition and index). v2 stays for relays
-- of version 15.
CREATE FUNCTION outbox.bucket_has_work_v3(sink text, bucket integer, snapshot pg_snapshot, target pg_snapshot,
                                          after_xid xid8, after_seq bigint)
    RETURNS boolean
    LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
DECLARE
    found boolean;
BEGIN
    -- The two halves of a delta: transactions open at the cursor's snapshot, and later ones; none is older
    -- than its xmin. Planned here, for this call, with the xmin a literal: a parameter (or a plan cached
    -- for any value) would plan, lock and start a probe of every xid range.
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM outbox.events e '
                   'WHERE e.bucket = $1 AND e.xid >= %L::xid8 '
                   'AND (e.xid >= pg_snapshot_xmax($2) OR e.xid IN (SELECT pg_snapshot_xip($2))) '
                   'AND NOT outbox.delivered_v1(e.xid, e.seq, $2, $3, $4, $5))',
                   pg_snapshot_xmin(snapshot))
        INTO found
        USING bucket, snapshot, target, after_xid, after_seq;
    RETURN found
        OR EXISTS (SELECT 1 FROM outbox.parked p
                   WHERE p.sink = bucket_has_work_v3.sink AND p.bucket = bucket_has_work_v3.bucket
                     AND p.available_at <= clock_timestamp()
                     AND NOT EXISTS (SELECT 1 FROM outbox.paused_keys k
                                     WHERE k.sink = p.sink AND k.partition_key = p.partition_key));
END
$$;

-- 0003_rebuilds: projection rebuilds in progress (see the migration for the design).
CREATE TABLE outbox.rebuilds (
    projection    text        NOT NULL,
    sink          text        NOT NULL,
    shadow_schema text        NOT NULL,
    live_tables   text[]      NOT NULL,  -- schema-qualified, in declaration order
    options       jsonb       NOT NULL DEFAULT '{}'::jsonb,  -- from_time / from_position
    total_events  bigint,
    started_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT rebuilds_pkey PRIMARY KEY (projection),
    CONSTRAINT rebuilds_sink_fkey FOREIGN KEY (sink) REFERENCES outbox.sinks (name) ON DELETE CASCADE
);

-- 0005_hardening (see the migration for why each part).
-- What an idempotency key stands for: the event's type, key and payload (jsonb text is canonical).
CREATE FUNCTION outbox.fingerprint_v1(type text, partition_key text, payload jsonb) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
    -- Length-prefixed, so that no two (type, key) pairs run together into the same text.
    RETURN sha256(convert_to(length(type) || ':' || type || length(partition_key) || ':' || partition_key
                             || payload::text, 'UTF8'));

-- 0010_quiet_producers (see the migration).
-- A header name as the reserved-name check compares it (0010): NFKC-normalised (fullwidth letters
-- become ASCII), without whitespace and invisible format characters, lower case, '-' read as '_'.
-- outbox_relay/event.py header_name_key is the same rule (and refuses at least what this refuses).
CREATE FUNCTION outbox.header_name_key_v1(name text) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE STRICT
    RETURN replace(lower(regexp_replace(
        CASE WHEN current_setting('server_encoding') = 'UTF8' THEN normalize(name, NFKC) ELSE name END,
        '[[:space:]\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0]',
        '', 'g')), '-', '_');

-- 0014_partitioned_history (see the migration).
-- Refuse an event the relays could not position, keep, or deliver; fingerprint an idempotent event
-- and record its key, skipping the row (NULL) when the key already stands for an event: the outcome
-- ON CONFLICT DO NOTHING gave on the unique index that 0014 replaced. 0018 (v4): and an occurred_at
-- outside 0001-01-02..9999-12-30 UTC. Otherwise check_event_v2.
CREATE FUNCTION outbox.check_event_v4() RETURNS trigger
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

CREATE TRIGGER events_check BEFORE INSERT ON outbox.events
    FOR EACH ROW
    WHEN (NEW.idempotency_key IS NOT NULL
          OR NEW.headers <> '{}'::jsonb
          OR NEW.xid IS DISTINCT FROM pg_current_xact_id()
          OR NEW.created_at IS DISTINCT FROM now()
          OR NEW.topic !~ '^[A-Za-z0-9._-]{1,249}$' OR NEW.topic IN ('.', '..')
          OR NEW.occurred_at NOT BETWEEN timestamptz '0001-01-02 00:00:00+00' AND timestamptz '9999-12-30 23:59:59.999999+00')
    EXECUTE FUNCTION outbox.check_event_v4();

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

-- One row: who runs housekeeping now and when it last finished. A relay claims a pass with one
-- UPDATE (the interval has passed since the last one finished, or a claimed pass went stale), so
-- one relay per interval does the work, and any relay can see when housekeeping last ran.
CREATE TABLE outbox.housekeeping (
    singleton   boolean     NOT NULL DEFAULT true CONSTRAINT housekeeping_singleton CHECK (singleton),
    run_by      text,
    started_at  timestamptz NOT NULL DEFAULT '-infinity',
    finished_at timestamptz NOT NULL DEFAULT '-infinity',
    CONSTRAINT housekeeping_pkey PRIMARY KEY (singleton),
    -- 0019: the default class's keep, stored by every pass from its relay's --retention-seconds: all that
    -- retention goes by (retire_partition_v1 and partition_hold_v1 keep at least this, whatever they are passed).
    default_keep interval   NOT NULL DEFAULT interval '604800 seconds'
                 CONSTRAINT housekeeping_default_keep_valid CHECK (default_keep >= interval '0')
);
INSERT INTO outbox.housekeeping DEFAULT VALUES;

-- 0006_projection_guards: a projection handler can not end the relay's transaction (see the
-- migration for the design).
-- Deferred constraint trigger on a projection connection's pg_temp.outbox_projection_batch (one row,
-- updated by every batch): the transaction commits only if projection_batch_end_v1 ran in it for
-- the batch's token.
CREATE FUNCTION outbox.projection_batch_guard_v1() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox_relay.batch_end', true) IS DISTINCT FROM NEW.token THEN
        RAISE EXCEPTION 'a projection handler ended the relay''s transaction (COMMIT or END) before its checkpoint; '
                        'nothing of the batch is kept'
            USING ERRCODE = 'invalid_transaction_termination',
                  HINT = 'a handler writes through the transaction it is given and never commits or rolls it back';
    END IF;
    RETURN NULL;
END
$$;

-- Run by the relay right before a projection batch's checkpoint: the batch is still in the
-- transaction it began (the token is transaction-local), and may now commit.
CREATE FUNCTION outbox.projection_batch_end_v1(token text) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox_relay.batch', true) IS DISTINCT FROM token THEN
        RAISE EXCEPTION 'the projection batch is no longer in the transaction it began (a handler ran COMMIT, END or '
                        'ROLLBACK); nothing of the batch is kept'
            USING ERRCODE = 'invalid_transaction_termination';
    END IF;
    PERFORM set_config('outbox_relay.batch_end', token, true);
END
$$;

-- 0007_snapshot_cursors (continued).
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

-- 0010_quiet_producers: producers notify nobody; one relay watches for commits and wakes the owners
-- (see the migration for the design).
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
-- 0024: its looks read the index whatever the statistics said when a session planned them.
ALTER FUNCTION outbox.watch_commits_v1(pg_snapshot, integer, double precision) SET enable_seqscan = off;

-- 0011_history_watermark: what retention has removed (see the migration; a new installation has
-- removed nothing).
CREATE TABLE outbox.history (
    singleton       boolean     NOT NULL DEFAULT true CONSTRAINT history_singleton CHECK (singleton),
    -- Every event created at or before this instant may have been removed (NULL: none was).
    removed_through timestamptz,
    -- The largest transaction id among the removed events (positions at or below it may be gone).
    removed_xid     xid8,
    removed_events  bigint      NOT NULL DEFAULT 0,
    removed_at      timestamptz,
    CONSTRAINT history_pkey PRIMARY KEY (singleton)
);
INSERT INTO outbox.history DEFAULT VALUES;

-- 0015_history_per_class (see the migration): what retention removed per class and topics, and
-- copies of parked and dead-lettered events whose partition went.
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

-- Whether removed history (a row of outbox.history_removed: its topics and except_topics) may hold
-- events of the topics a sink reads (reads NULL: every topic, and events without one).
CREATE FUNCTION outbox.history_covers_v1(topics text[], except_topics text[], reads text[]) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN reads IS NULL
        OR CASE WHEN topics IS NOT NULL THEN topics && reads ELSE NOT (reads <@ except_topics) END;

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

-- 0014_partitioned_history (continued): partitions made ahead and retired whole.
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
    -- 0019: a leaf of outbox.events only, not any table the caller names.
    IF NOT EXISTS (SELECT FROM outbox.partitions p WHERE p.name = leaf) THEN
        RETURN NULL;
    END IF;
    EXECUTE format('SELECT min(created_at) FROM outbox.%I', leaf) INTO oldest;
    RETURN oldest;
END
$$;

-- 0015 (after partition_oldest_v1, which its body names).
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
-- it, and (0015) a parked event or a dead letter in its xid range while a relay older than schema
-- version 15 is alive (it reads a parked event from its partition only).
CREATE FUNCTION outbox.partition_hold_v1(leaf text, default_keep interval) RETURNS text
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

-- Remove the oldest leaf that nothing holds (partition_hold_v1): drop it (events_default: TRUNCATE,
-- it stays to catch events no range covers), with its events' idempotency keys, and move the history
-- watermark (0011) past its events, per class and topics too (0015). Its parked and dead-lettered events
-- are kept as copies first (outbox.kept_events, 0015), with their keys. Returns the leaf and how many
-- events left with it; no row when nothing may go. The caller sets lock_timeout (dropping a partition
-- locks the table for a moment). As the schema's owner (only an owner may drop partitions): relays run it with EXECUTE alone.
CREATE FUNCTION outbox.retire_partition_v1(default_keep interval,
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

-- 0019: retire the oldest leaf that may go, by the stored keep (outbox.housekeeping.default_keep) and the
-- classes, with no argument: the relays' call. As the schema's owner; relays only (outbox_relay/privileges.py).
CREATE FUNCTION outbox.retire_partition_v2(OUT leaf text, OUT removed bigint, OUT newest timestamptz)
    RETURNS SETOF record
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN QUERY SELECT r.leaf, r.removed, r.newest FROM outbox.retire_partition_v1(NULL) r;
END
$$;

-- The first range, from now on.
SELECT outbox.add_partition_v1(1000000, 86400);

-- 0023_console_audit: the console's audit records and per-minute samples (see the migration).
CREATE TABLE outbox.console_audit (
    id          bigint      GENERATED ALWAYS AS IDENTITY,
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    who         text        NOT NULL,
    -- The database role the console ran as.
    role        text        NOT NULL DEFAULT session_user,
    action      text        NOT NULL,
    sink        text,
    target      text        NOT NULL,
    count       integer     NOT NULL DEFAULT 0,
    -- NULL: done; else why it was refused.
    refused     text,
    CONSTRAINT console_audit_pkey PRIMARY KEY (id)
);

CREATE TABLE outbox.console_samples (
    sink         text        NOT NULL,
    at           timestamptz NOT NULL,
    pending      bigint      NOT NULL,
    parked       bigint      NOT NULL,
    dead_letters bigint      NOT NULL,
    published    bigint      NOT NULL,
    CONSTRAINT console_samples_pkey PRIMARY KEY (sink, at)
);

CREATE INDEX console_samples_at ON outbox.console_samples (at, sink);

-- A sink's dead letters newest first (the console's and `dead-letters list`'s page): an index range read
-- backwards, not a sort of every dead letter of the sink (10,000 of them in the console's bench).
CREATE INDEX dead_letters_newest ON outbox.dead_letters (sink, dead_at, event_id);

-- 0019_privileges: nothing in the schema is open to PUBLIC (migrate repeats this after every run); the
-- documented roles' grants are in outbox_relay/privileges.py (docs/roles.md).
REVOKE ALL ON SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox FROM PUBLIC;

-- The migrations this snapshot contains.
INSERT INTO outbox.schema_migrations (version, name, min_code_version) VALUES
    (1, 'initial', NULL),
    (2, 'crash_isolation', NULL),
    (3, 'rebuilds', NULL),
    (4, 'retention_index', NULL),
    (5, 'hardening', 5),
    (6, 'projection_guards', NULL),
    (7, 'snapshot_cursors', 7),
    (8, 'paused_keys', 8),
    (9, 'park_order', NULL),
    (10, 'quiet_producers', NULL),
    (11, 'history_watermark', NULL),
    (12, 'event_versions', NULL),
    (13, 'sink_kinds', NULL),
    (14, 'partitioned_history', NULL),
    (15, 'history_per_class', NULL),
    (16, 'lapse_check_pruned', NULL),
    (17, 'position_order_index', NULL),
    (18, 'occurred_at_range', NULL),
    (19, 'privileges', NULL),
    (20, 'retention_recheck', NULL),
    (21, 'fenced_by', NULL),
    (22, 'idle_watch', NULL),
    (23, 'console_audit', NULL),
    (24, 'watch_plan', NULL);
