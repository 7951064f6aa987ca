-- 0008_paused_keys: an operator can hold one partition key of one sink (outbox-relay keys pause) and
-- let it go again (keys resume).
-- min-code-version: 8
--
-- A paused key is treated like a key whose head failed: the relay reads its events and parks them
-- (the bucket's cursor moves on, so the rest of the bucket flows), queued in position order, and
-- retries none of them while the pause lasts. Resuming deletes the row and makes the parked events
-- due at once. Nothing is lost (parked events are kept by retention) and the key's order holds.
--
-- Relays of earlier versions do not read this table: they would go on delivering a paused key's
-- events as if nothing were paused. Hence min-code-version 8: they refuse to start against this
-- schema. Relays of those versions that are already running when it is applied do not notice;
-- finish rolling every relay to this version before you pause a key.

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

-- A lease lapse counts only when the bucket had work (crash-loop isolation). The parked events of
-- a paused key are not work while it is paused: the relay does not retry them, so a crash can not
-- be theirs. Same signature and meaning as before whenever nothing is paused.
CREATE OR REPLACE FUNCTION outbox.bucket_has_work_v2(sink text, bucket integer, snapshot pg_snapshot,
                                                     target pg_snapshot, after_xid xid8, after_seq bigint)
    RETURNS boolean
    LANGUAGE sql STABLE PARALLEL SAFE
    RETURN EXISTS (SELECT 1 FROM outbox.events e
                   WHERE e.bucket = bucket_has_work_v2.bucket
                     AND (e.xid >= pg_snapshot_xmax(bucket_has_work_v2.snapshot)
                          OR e.xid IN (SELECT pg_snapshot_xip(bucket_has_work_v2.snapshot)))
                     AND NOT outbox.delivered_v1(e.xid, e.seq, bucket_has_work_v2.snapshot, bucket_has_work_v2.target,
                                                 bucket_has_work_v2.after_xid, bucket_has_work_v2.after_seq))
        OR EXISTS (SELECT 1 FROM outbox.parked p
                   WHERE p.sink = bucket_has_work_v2.sink AND p.bucket = bucket_has_work_v2.bucket
                     AND p.available_at <= clock_timestamp()
                     AND NOT EXISTS (SELECT 1 FROM outbox.paused_keys k
                                     WHERE k.sink = p.sink AND k.partition_key = p.partition_key));
