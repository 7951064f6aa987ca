-- 0011_history_watermark: what retention has removed, so that a rebuild is never silently partial.
--
-- A rebuild replays stored events into empty tables. If retention has removed events the projection
-- had applied, the rebuilt model lacks them and nothing said so. Now:
-- - outbox.history records how far retention has removed events: the newest created_at and the
--   largest transaction id among the events it deleted (apply_retention), and how many in all;
-- - each sink records the watermark its history began at (sinks.history_from: the history's
--   removed_through when the sink was registered, or when a rebuild's model replaced it; NULL:
--   before anything was removed);
-- - a rebuild refuses when retention has removed more since its projection's history began, naming
--   from when history exists, unless told to accept a partial model (projections/rebuild.py).
--
-- Installations that deleted events before this migration: which ones is not known. If retention
-- (or anything) ever deleted from outbox.events (pg_stat_user_tables counts it), everything before
-- the oldest event still stored counts as removed, so their projections' first full rebuild asks to
-- be accepted as partial. No min-code-version: older relays keep working (their retention does not
-- move the watermark, which only makes rebuilds refuse too little, until they are replaced).

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
INSERT INTO outbox.history (removed_through, removed_xid, removed_at)
SELECT (SELECT min(created_at) FROM outbox.events) - interval '1 microsecond',
       (SELECT min(xid) FROM outbox.events), clock_timestamp()
WHERE (SELECT coalesce(sum(n_tup_del), 0) FROM pg_stat_user_tables WHERE relid = 'outbox.events'::regclass) > 0;
INSERT INTO outbox.history DEFAULT VALUES ON CONFLICT DO NOTHING;

ALTER TABLE outbox.sinks ADD COLUMN history_from timestamptz;
