-- 0002_crash_isolation: count a lease lapse only when the bucket had work.
--
-- A lapse (a lease that ran out, or a dead owner's lease taken back) is evidence of a crash
-- loop only if the owner had something to deliver there. Idle buckets of a worker that was
-- killed must not drift towards crash-loop isolation.

-- Whether a bucket of a sink has something deliverable now: an event past its cursor that
-- is below the read horizon, or a parked event whose retry is due.
CREATE FUNCTION outbox.bucket_has_work_v1(sink text, bucket integer, position_xid xid8, position_seq bigint)
    RETURNS boolean
    LANGUAGE sql STABLE PARALLEL SAFE
    RETURN EXISTS (SELECT 1 FROM outbox.events e
                   WHERE e.bucket = bucket_has_work_v1.bucket
                     AND (e.xid, e.seq) > (bucket_has_work_v1.position_xid, bucket_has_work_v1.position_seq)
                     AND e.xid < pg_snapshot_xmin(pg_current_snapshot()))
        OR EXISTS (SELECT 1 FROM outbox.parked p
                   WHERE p.sink = bucket_has_work_v1.sink AND p.bucket = bucket_has_work_v1.bucket
                     AND p.available_at <= clock_timestamp());
