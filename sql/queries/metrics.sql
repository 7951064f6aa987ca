-- Queries of the metrics endpoint (outbox_relay/metrics.py), refreshed in the background every
-- --metrics-refresh-seconds on a connection of their own, never on a scrape or a relay's path.

-- name: floor
-- The lowest xmin of every cursor's snapshot: no undelivered event is older. The queries below take it as
-- a parameter so that the planner prunes the xid ranges below it (their per-cursor bounds are known only
-- at run time, and a plan over every partition locks each one: thousands of locks with history kept).
SELECT min(pg_snapshot_xmin(snapshot))::text FROM outbox.cursors;

-- name: sinks
-- Per live sink: committed events not yet delivered, the age of the oldest, parked (waiting for a
-- retry), held by paused keys (waiting for an operator), paused keys, dead-lettered.
SELECT s.name,
       coalesce(sum(b.pending), 0)::bigint,
       extract(epoch FROM clock_timestamp() - min(b.oldest))::float8,
       (SELECT count(*) FROM outbox.parked p WHERE p.sink = s.name
          AND NOT EXISTS (SELECT 1 FROM outbox.paused_keys k
                          WHERE k.sink = p.sink AND k.partition_key = p.partition_key)),
       (SELECT count(*) FROM outbox.parked p
        JOIN outbox.paused_keys k ON k.sink = p.sink AND k.partition_key = p.partition_key
        WHERE p.sink = s.name),
       (SELECT count(*) FROM outbox.paused_keys k WHERE k.sink = s.name),
       (SELECT count(*) FROM outbox.dead_letters d WHERE d.sink = s.name)
FROM outbox.sinks s
JOIN outbox.cursors c ON c.sink = s.name
CROSS JOIN LATERAL (
    -- An index range per bucket, from the oldest transaction its cursor has not seen.
    SELECT count(*) AS pending, min(e.created_at) AS oldest
    FROM outbox.events e
    WHERE e.bucket = c.bucket AND e.xid >= pg_snapshot_xmin(c.snapshot) AND e.xid >= %(floor)s::xid8
      AND NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq)
) b
WHERE s.dropped_at IS NULL
GROUP BY s.name;

-- name: key_lag
-- Per sink, the keys with the most undelivered events and those whose oldest undelivered event is the
-- oldest: the top %(top)s of each.
WITH undelivered AS (
    SELECT c.sink, e.partition_key, count(*) AS pending, min(e.created_at) AS oldest
    FROM outbox.cursors c
    JOIN outbox.events e ON e.bucket = c.bucket AND e.xid >= pg_snapshot_xmin(c.snapshot)
                        AND e.xid >= %(floor)s::xid8
                        AND NOT outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq)
    GROUP BY c.sink, e.partition_key
),
ranked AS (
    SELECT u.*,
           row_number() OVER (PARTITION BY u.sink ORDER BY u.pending DESC, u.partition_key) AS by_count,
           row_number() OVER (PARTITION BY u.sink ORDER BY u.oldest, u.partition_key) AS by_age
    FROM undelivered u
)
SELECT sink, partition_key, pending, extract(epoch FROM clock_timestamp() - oldest)::float8
FROM ranked
WHERE by_count <= %(top)s OR by_age <= %(top)s;

-- name: cluster
-- The oldest open writing transaction on the server (seconds; NULL: none), a session's or a prepared
-- one (as `status` shows: admin.sql horizon_holder), and seconds since housekeeping last finished.
SELECT (SELECT extract(epoch FROM clock_timestamp() - min(since))::float8
        FROM (
            -- Sessions whose transaction has written (only those have a transaction id).
            SELECT xact_start AS since FROM pg_stat_activity WHERE backend_xid IS NOT NULL
            UNION ALL
            -- Prepared (two-phase) transactions: no session left, they hold the horizon until
            -- COMMIT/ROLLBACK PREPARED.
            SELECT prepared FROM pg_prepared_xacts
        ) holders),
       (SELECT CASE WHEN finished_at = '-infinity' THEN NULL
                    ELSE extract(epoch FROM clock_timestamp() - finished_at)::float8 END
        FROM outbox.housekeeping);
