-- name: horizon
-- Where a replay stops: events of transactions that end later are not part of it (the relays
-- deliver them as usual).
SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint;

-- name: count
-- How many stored events a replay will send (for its progress line).
SELECT count(*)
FROM outbox.events e
WHERE e.bucket = ANY(%(buckets)s::int[])
  AND e.xid < %(until)s::text::xid8
  AND coalesce(e.topic, %(default_topic)s) = %(topic)s
  AND (%(from_time)s::timestamptz IS NULL OR e.created_at >= %(from_time)s::timestamptz)
  AND (%(to_time)s::timestamptz IS NULL OR e.created_at < %(to_time)s::timestamptz)
  AND (%(key)s::text IS NULL OR e.partition_key = %(key)s::text);

-- name: page
-- The next events of each bucket after the replay's position there, in (xid, seq) order (per key
-- the live order but for overlapping transactions, see replay.py): one index range per bucket, filtered.
SELECT e.bucket, e.xid::text::bigint AS xid, e.seq, e.id, e.partition_key, e.topic, e.type,
       e.payload::text AS payload, e.headers::text AS headers, coalesce(e.occurred_at, e.created_at) AS time,
       -- Ready-made header values for the Kafka sink (formatting in SQL costs less than in Python).
       e.id::text AS id_text,
       to_char(coalesce(e.occurred_at, e.created_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS time_text,
       lpad(e.xid::text, 20, '0') || '-' || lpad(e.seq::text, 20, '0') AS sequence_text,
       e.schema_version AS version
FROM unnest(%(buckets)s::int[], %(xids)s::bigint[], %(seqs)s::bigint[]) AS b(bucket, xid, seq)
CROSS JOIN LATERAL (
    SELECT *
    FROM outbox.events e
    WHERE e.bucket = b.bucket
      AND (e.xid, e.seq) > (b.xid::text::xid8, b.seq)
      AND e.xid < %(until)s::text::xid8
      AND coalesce(e.topic, %(default_topic)s) = %(topic)s
      AND (%(from_time)s::timestamptz IS NULL OR e.created_at >= %(from_time)s::timestamptz)
      AND (%(to_time)s::timestamptz IS NULL OR e.created_at < %(to_time)s::timestamptz)
      AND (%(key)s::text IS NULL OR e.partition_key = %(key)s::text)
    ORDER BY e.xid, e.seq
    LIMIT %(limit)s
) e
ORDER BY e.bucket, e.xid, e.seq;

-- name: bucket_of
SELECT outbox.bucket_v1(%(key)s);
