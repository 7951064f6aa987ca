-- 0016_lapse_check_pruned: the lapse check plans and locks only the partitions of outbox.events from the
-- cursor's snapshot on.
--
-- Whether a bucket had work when its lease was lost (outbox.bucket_has_work_v2: expire_leases in
-- housekeeping, acquire_leases taking a lease over) names the cursor snapshot's xmin as the lower bound of
-- its events probe, but as a value known only while the function runs: its plan covers every xid range,
-- so each statement that called it planned and locked every partition and index of outbox.events (with
-- 300 ranges kept: 4,500 locks and 0.8 s for acquire_leases taking over 64 buckets,
-- bench/results/2026-11-26-read-cost.md). outbox.bucket_has_work_v3 gives the same answer; it runs the
-- events probe as a statement planned per call with the xmin written into it as a constant, so the
-- planner leaves out the ranges below it, however many are kept.
--
-- bucket_has_work_v2 stays: relays of the previous version call it (their membership and housekeeping
-- queries). No min-code-version: they keep running against this schema.

-- Whether a bucket of a sink has something deliverable now, as bucket_has_work_v2: a committed event its
-- cursor has not delivered, or a parked event whose retry is due (of a key that is not paused).
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
