-- name: event_progress
-- Where each given event stands for one sink (done, pending, parked, paused, dead or unknown), by index probes only.
WITH sink AS (
    -- Exactly one row, so the result always answers for the sink (event columns NULL when no ids are
    -- given). A registered sink has one cursor row per bucket; none at all means the name is unknown.
    SELECT EXISTS (SELECT 1 FROM outbox.cursors WHERE sink = %(sink)s AND bucket = 0) AS known
),
wanted AS (
    -- The ids asked about, each once (the caller de-duplicates).
    SELECT w.id FROM unnest(%(event_ids)s::uuid[]) AS w(id)
)
SELECT s.known,
       w.id,
       -- A parked row means another attempt will come, so it wins over an (older) dead letter; an id with
       -- no event row was never committed, rolled back, or was already removed by retention. An event of
       -- a key an operator paused for the sink is held, parked or about to be, until the key is resumed:
       -- no attempt comes before that.
       CASE WHEN p.seq IS NOT NULL AND k.partition_key IS NOT NULL THEN 'paused'
            WHEN p.seq IS NOT NULL THEN 'parked'
            WHEN d.event_id IS NOT NULL THEN 'dead'
            WHEN e.id IS NULL THEN 'unknown'
            WHEN outbox.delivered_v1(e.xid, e.seq, c.snapshot, c.target, c.after_xid, c.after_seq) THEN 'done'
            WHEN k.partition_key IS NOT NULL THEN 'paused'
            ELSE 'pending' END AS state,
       coalesce(p.attempts, d.attempts) AS attempts,
       coalesce(p.last_error, h.last_error, d.last_error) AS last_error,
       -- Diagnostics for a timeout: is a relay holding the event's bucket, and the key's pause.
       c.owner IS NOT NULL AND c.lease_expires_at > clock_timestamp() AS leased,
       e.partition_key AS key, k.paused_by, k.reason AS pause_reason
FROM sink s
LEFT JOIN wanted w ON true
-- One primary-key probe per id in each of the tables below.
LEFT JOIN LATERAL (
    -- The event: in its partition, or (0015) its copy, kept for a parked row or dead letter once
    -- retention dropped the partition.
    (SELECT e.id, e.bucket, e.xid, e.seq, e.partition_key FROM outbox.events e WHERE e.id = w.id LIMIT 1)
    UNION ALL
    (SELECT k.id, k.bucket, k.xid, k.seq, k.partition_key FROM outbox.kept_events k WHERE k.id = w.id LIMIT 1)
    LIMIT 1
) e ON true
LEFT JOIN outbox.cursors c ON c.sink = %(sink)s AND c.bucket = e.bucket
LEFT JOIN outbox.parked p ON p.sink = %(sink)s AND p.bucket = e.bucket AND p.xid = e.xid AND p.seq = e.seq
LEFT JOIN outbox.paused_keys k ON k.sink = %(sink)s AND k.partition_key = e.partition_key
LEFT JOIN LATERAL (
    -- LIMIT keeps this a probe per id (a plain join may be planned as a scan of all the sink's dead letters).
    SELECT d.event_id, d.attempts, d.last_error
    FROM outbox.dead_letters d
    WHERE d.sink = %(sink)s AND d.event_id = w.id
    LIMIT 1
) d ON true
LEFT JOIN LATERAL (
    -- An event parked behind its key's failing head has no error of its own: report the head's
    -- (the key's first parked event in chain order, first entry of index parked_key).
    SELECT q.last_error
    FROM outbox.parked q
    WHERE p.seq IS NOT NULL AND p.last_error IS NULL
      AND q.sink = p.sink AND q.bucket = p.bucket AND q.partition_key = p.partition_key
    ORDER BY q.place
    LIMIT 1
) h ON true;
