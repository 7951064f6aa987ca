-- name: heartbeat
-- Register this worker or refresh it, and read, for each of its sinks, the stored assignment and the
-- live members now (one round trip per heartbeat). Each worker is judged live by the TTL it declared
-- (metadata ttl_seconds; %(ttl)s for rows without one), so relays with different settings agree. A
-- registration of this id by another relay process (another metadata instance) is left alone while
-- its heartbeat is fresh: registered is false and holder says whose it is (worker.py refuses to run,
-- or takes over a crashed run's registration with take_over).
WITH beat AS (
    INSERT INTO outbox.workers AS w (id, status, sinks, metadata)
    VALUES (%(worker)s, %(status)s, %(sinks)s::text[], %(metadata)s::jsonb)
    ON CONFLICT (id) DO UPDATE
        SET status = EXCLUDED.status, sinks = EXCLUDED.sinks,
            -- A second relay refused under this id (clash) stays on record while this one runs.
            metadata = EXCLUDED.metadata
                       || CASE WHEN w.metadata ->> 'instance' = EXCLUDED.metadata ->> 'instance' AND w.metadata ? 'clash'
                               THEN jsonb_build_object('clash', w.metadata -> 'clash') ELSE '{}'::jsonb END,
            last_seen_at = clock_timestamp()
        WHERE w.metadata ->> 'instance' IS NOT DISTINCT FROM EXCLUDED.metadata ->> 'instance'
           OR w.status = 'dead'
           OR w.last_seen_at <= clock_timestamp()
                                - make_interval(secs => coalesce((w.metadata ->> 'ttl_seconds')::float8, %(ttl)s))
           OR %(take_over)s
    RETURNING w.id
)
SELECT s.sink, a.generation, a.members, a.owners,
       ARRAY(
           -- Live: alive (not draining) and heard from within its own TTL. This statement does not see its
           -- own upsert, so this worker is added as the heartbeat says it is.
           SELECT m.id FROM (
               SELECT w.id FROM outbox.workers w
               WHERE w.id <> %(worker)s AND w.status = 'alive' AND s.sink = ANY(w.sinks)
                 AND w.last_seen_at > clock_timestamp()
                                      - make_interval(secs => coalesce((w.metadata ->> 'ttl_seconds')::float8, %(ttl)s))
               UNION ALL
               SELECT %(worker)s WHERE %(status)s = 'alive'
           ) m
           ORDER BY m.id) AS live,
       EXISTS (SELECT 1 FROM beat) AS registered,
       -- The registration as it was before this statement: another relay's when registered is false.
       (SELECT jsonb_build_object(
                   'host', w.metadata ->> 'host', 'pid', w.metadata ->> 'pid',
                   'seen_seconds_ago', extract(epoch FROM clock_timestamp() - w.last_seen_at)::float8,
                   'ttl_seconds', coalesce((w.metadata ->> 'ttl_seconds')::float8, %(ttl)s))
        FROM outbox.workers w WHERE w.id = %(worker)s) AS holder
FROM unnest(%(sinks)s::text[]) AS s(sink)
LEFT JOIN outbox.assignments a ON a.sink = s.sink;

-- name: heartbeat_existing
-- Refresh this registered worker only (draining): a heartbeat that arrives after the worker left must not
-- bring its row back, nor touch another relay's registration of the id. Reads the assignments like
-- heartbeat; a draining worker is not live.
WITH beat AS (
    UPDATE outbox.workers
    SET status = %(status)s, sinks = %(sinks)s::text[],
        metadata = %(metadata)s::jsonb || jsonb_strip_nulls(jsonb_build_object('clash', metadata -> 'clash')),
        last_seen_at = clock_timestamp()
    WHERE id = %(worker)s AND metadata ->> 'instance' IS NOT DISTINCT FROM %(metadata)s::jsonb ->> 'instance'
)
SELECT s.sink, a.generation, a.members, a.owners,
       ARRAY(SELECT w.id FROM outbox.workers w
             WHERE w.id <> %(worker)s AND w.status = 'alive' AND s.sink = ANY(w.sinks)
               AND w.last_seen_at > clock_timestamp()
                                    - make_interval(secs => coalesce((w.metadata ->> 'ttl_seconds')::float8, %(ttl)s))
             ORDER BY w.id) AS live,
       true AS registered, NULL::jsonb AS holder
FROM unnest(%(sinks)s::text[]) AS s(sink)
LEFT JOIN outbox.assignments a ON a.sink = s.sink;

-- name: record_clash
-- A second relay refused under this id: say so on the registration that stands (`status` shows it).
UPDATE outbox.workers
SET metadata = metadata || jsonb_build_object('clash', jsonb_build_object(
        'host', %(host)s::text, 'pid', %(pid)s::int, 'at', clock_timestamp()))
WHERE id = %(worker)s;

-- name: reassign
-- Store a sink's new assignment unless another relay changed it since it was read (compare-and-set on
-- the generation; none read: there was no row), and tell the relays of the sink at once.
WITH stored AS (
    INSERT INTO outbox.assignments AS a (sink, generation, members, owners)
    VALUES (%(sink)s, 1, %(members)s::text[], %(owners)s::text[])
    ON CONFLICT (sink) DO UPDATE
        SET generation = a.generation + 1, members = EXCLUDED.members, owners = EXCLUDED.owners,
            changed_at = clock_timestamp()
        WHERE a.generation = %(generation)s
    RETURNING a.generation
)
SELECT generation, pg_notify('outbox_membership_v1', %(sink)s) FROM stored;

-- name: leave
-- Clean exit: the worker is gone from the registry at once (unless the id is another relay's now).
DELETE FROM outbox.workers
WHERE id = %(worker)s AND (%(instance)s::text IS NULL OR metadata ->> 'instance' IS NOT DISTINCT FROM %(instance)s);

-- name: acquire_leases
-- Lease free or expired buckets of one sink, or take up again, under a new fence, one still in
-- this worker's name (its fence was bumped, or it restarted with the same id). Each acquisition
-- bumps the fence; taking over an expired lease (or another worker's, or one of this worker id's that
-- this process never held: %(restarted)s, a predecessor of the same id that died) of a bucket that had
-- work counts a lapse (crash-loop isolation).
UPDATE outbox.cursors c
SET owner            = %(worker)s,
    fence            = c.fence + 1,
    lapses           = c.lapses + CASE WHEN c.owner IS NOT NULL
                                        AND (c.owner <> %(worker)s OR c.lease_expires_at < clock_timestamp()
                                             OR c.bucket = ANY(%(restarted)s::int[]))
                                        AND outbox.bucket_has_work_v3(c.sink, c.bucket, c.snapshot, c.target,
                                                                      c.after_xid, c.after_seq)
                                       THEN 1 ELSE 0 END,
    lease_expires_at = clock_timestamp() + make_interval(secs => %(lease_seconds)s),
    fenced_by        = NULL
WHERE c.sink = %(sink)s
  AND c.bucket = ANY(%(buckets)s::int[])
  AND (c.owner IS NULL OR c.owner = %(worker)s OR c.lease_expires_at < clock_timestamp())
RETURNING c.bucket, c.fence, c.lapses, c.snapshot::text, c.target::text, c.after_xid::text, c.after_seq;

-- name: renew_leases
-- Extend the leases this worker still holds under the same fence; missing buckets were lost. A lease
-- that a cursor write extended within the last sixth of its length (relay.advance) is only confirmed
-- (locked, which leaves no row version): every write is a dead row version while a long transaction
-- holds vacuum back, and renewals come every third of the lease.
WITH t AS MATERIALIZED (
    -- One clock for both decisions below.
    SELECT clock_timestamp() AS now
),
held AS (
    -- Still ours: locked, so that a concurrent change of owner or fence is waited for and seen.
    SELECT c.bucket, c.lease_expires_at
    FROM outbox.cursors c
    JOIN unnest(%(buckets)s::int[], %(fences)s::bigint[]) AS v(bucket, fence)
      ON c.sink = %(sink)s AND c.bucket = v.bucket
    CROSS JOIN t
    WHERE c.owner = %(worker)s AND c.fence = v.fence AND c.lease_expires_at > t.now
    FOR NO KEY UPDATE OF c
),
renewed AS (
    -- Written only where the lease is not fresh.
    UPDATE outbox.cursors c
    SET lease_expires_at = t.now + make_interval(secs => %(lease_seconds)s)
    FROM held h CROSS JOIN t
    WHERE c.sink = %(sink)s AND c.bucket = h.bucket
      AND h.lease_expires_at <= t.now + make_interval(secs => %(lease_seconds)s * 5 / 6)
)
SELECT bucket FROM held;

-- name: release_leases
-- Hand buckets back without waiting for expiry (a changed assignment, drain).
UPDATE outbox.cursors c
SET owner = NULL, lease_expires_at = NULL
FROM unnest(%(buckets)s::int[], %(fences)s::bigint[]) AS v(bucket, fence)
WHERE c.sink = %(sink)s AND c.bucket = v.bucket
  AND c.owner = %(worker)s AND c.fence = v.fence
RETURNING c.bucket;

-- name: announce_buckets
-- Tell the relays that want these buckets (their next owners) that they are free now: the same
-- channel and payload as a commit's notification, so they try at once instead of at their next poll.
SELECT pg_notify('outbox_events_v2', %(buckets)s);

-- name: why_fenced
-- Why this worker lost buckets it thought it held: per bucket, the operator action that re-fenced it while
-- the lease stayed in this worker's name (keys skip, a rebuild's switch-over), else NULL (a takeover, or
-- the lease ran out).
SELECT c.bucket, c.fenced_by
FROM outbox.cursors c
WHERE c.sink = %(sink)s AND c.bucket = ANY(%(buckets)s::int[])
  AND c.owner = %(worker)s AND c.lease_expires_at >= clock_timestamp() AND c.fenced_by IS NOT NULL;

-- name: vacuum_horizon
-- The oldest transaction id that holds back vacuum of this database's tables, and for how long its
-- transaction has been open where this role may see that (NULL otherwise; no row: nothing holds it):
-- a session's transaction (backend_xid, any database: it is in every snapshot taken meanwhile), a
-- snapshot (backend_xmin) of a session of this database or of a standby's walsender, a prepared
-- transaction, or a replication slot. horizon.py counts the horizon as held when that transaction has
-- been open for a second, or when the same id stayed the oldest between heartbeats: only then is a
-- cursor write worth deferring (every write is a dead row version it keeps). No query text is read.
WITH holders AS (
    -- Sessions other than this one (its own statement has a snapshot too). xact_start is NULL for
    -- other roles' sessions unless this role has pg_read_all_stats.
    SELECT backend_xid AS x, xact_start AS since
    FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND backend_xid IS NOT NULL
    UNION ALL
    SELECT backend_xmin, xact_start FROM pg_stat_activity
    WHERE pid <> pg_backend_pid() AND backend_xmin IS NOT NULL
      -- (autovacuum's VACUUM holds back no other table's pruning, and a long one is routine)
      AND backend_type <> 'autovacuum worker'
      AND (datname = current_database() OR backend_type = 'walsender')
    UNION ALL
    -- Prepared (two-phase) transactions: no session left, held until COMMIT/ROLLBACK PREPARED.
    SELECT transaction, prepared FROM pg_prepared_xacts
    UNION ALL
    -- A slot's xmin (a standby's hot_standby_feedback, a logical slot being created).
    SELECT xmin, NULL FROM pg_replication_slots WHERE xmin IS NOT NULL
)
SELECT x::text AS horizon, extract(epoch FROM clock_timestamp() - since)::float8 AS open_seconds
FROM holders
ORDER BY age(x) DESC, since
LIMIT 1;
