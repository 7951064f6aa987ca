-- 0003_rebuilds: projection rebuilds in progress, so that an interrupted one resumes.
--
-- A rebuild replays stored events into fresh copies of a projection's tables (a shadow
-- schema) through a sink of its own ("<projection>.rebuild": its own cursors, retries and
-- dead letters), then swaps the copies in and hands its positions to the live projection in
-- one transaction. This row remembers what it was started with.
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
