-- Queries of `outbox-relay verify` (outbox_relay/verify/history.py): what a sink should have received,
-- read in bounded pages. Read only.

-- name: sink
-- The sink as registered: its kind, the topics it reads (NULL: all), whether it was dropped.
SELECT s.kind, s.topics, s.dropped_at IS NOT NULL AS dropped
FROM outbox.sinks s
WHERE s.name = %(sink)s;

-- name: removed
-- What retention removed of the topics the sink reads: how many events, the newest removed one's time.
SELECT coalesce(sum(r.removed_events), 0)::bigint AS removed_events, max(r.removed_through) AS removed_through
FROM outbox.history_removed r
WHERE outbox.history_covers_v1(r.topics, r.except_topics, %(topics)s::text[]);

-- name: commit_times
-- Whether the server records commit times (track_commit_timestamp): they tell overlapping transactions apart.
SELECT current_setting('track_commit_timestamp')::boolean;

-- name: topics
-- The topics of the stored events (one pass over the history; for a sink that reads every topic).
SELECT DISTINCT e.topic FROM outbox.events e WHERE e.topic IS NOT NULL ORDER BY 1;

-- name: stored_page
-- One page of one bucket's stored events in position order after (after_xid, after_seq), with what the
-- sink's records say of each (outbox_relay/verify/check.py, STATES). Kept events (parked or dead-lettered
-- ones whose partition retention dropped) are read with the others.
SELECT h.id, h.partition_key, h.xid::text::bigint AS xid, h.seq,
       -- Of a topic it does not read (default_topic: where a Kafka sink sends events without one).
       CASE WHEN %(topics)s::text[] IS NOT NULL
                 AND NOT coalesce(coalesce(h.topic, %(default_topic)s::text) = ANY(%(topics)s::text[]), false)
                THEN 'unrouted'
            WHEN EXISTS (SELECT 1 FROM outbox.dead_letters d WHERE d.sink = %(sink)s AND d.event_id = h.id)
                THEN 'dead'
            -- Parked: retrying, or held by a paused key.
            WHEN EXISTS (SELECT 1 FROM outbox.parked p
                         WHERE p.sink = %(sink)s AND p.bucket = h.bucket AND p.xid = h.xid AND p.seq = h.seq)
                THEN 'pending'
            WHEN outbox.delivered_v1(h.xid, h.seq, c.snapshot, c.target, c.after_xid, c.after_seq) THEN 'delivered'
            ELSE 'pending'  -- past the cursor
       END AS state,
       h.created_at AS started_at,
       -- NULL for transactions committed before the setting was on.
       CASE WHEN %(commit_times)s THEN pg_xact_commit_timestamp(h.xid::xid) END AS committed_at
FROM (
    (SELECT e.id, e.partition_key, e.bucket, e.xid, e.seq, e.topic, e.created_at
     FROM outbox.events e
     WHERE e.bucket = %(bucket)s AND (e.xid, e.seq) > (%(after_xid)s::text::xid8, %(after_seq)s)
     ORDER BY e.xid, e.seq LIMIT %(limit)s)
    UNION ALL
    (SELECT k.id, k.partition_key, k.bucket, k.xid, k.seq, k.topic, k.created_at
     FROM outbox.kept_events k
     WHERE k.bucket = %(bucket)s AND (k.xid, k.seq) > (%(after_xid)s::text::xid8, %(after_seq)s)
     ORDER BY k.xid, k.seq LIMIT %(limit)s)
) h
JOIN outbox.cursors c ON c.sink = %(sink)s AND c.bucket = %(bucket)s
ORDER BY h.xid, h.seq
LIMIT %(limit)s;

-- name: begin_snapshot
-- First statement of the check's transaction: every read sees the cursors and events as of one moment,
-- taken before the sink is read back (so whatever the cursors say was delivered was acknowledged before).
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY;

-- name: stored_ids
-- Which of these ids are stored (events or kept events): read back, but committed after the check's snapshot.
SELECT e.id FROM outbox.events e WHERE e.id = ANY(%(ids)s::uuid[])
UNION
SELECT k.id FROM outbox.kept_events k WHERE k.id = ANY(%(ids)s::uuid[]);
