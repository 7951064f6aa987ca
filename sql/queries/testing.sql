-- name: published
-- The events this connection can see (its own open transaction's included), of one key, type, topic or set of ids if given, in the relay's order.
-- (xid, seq) order: per key the order the relays deliver in, except for two transactions of one key
-- that overlapped, which a relay may deliver in the order they became visible to it instead
-- (docs/design-read-path.md, "What order one key gets"). Every parameter may be NULL (no filter); a key narrows the read to its bucket's range of events_position. The columns
-- start like the relay's fetch_events (store.stored_event builds a StoredEvent from them).
SELECT e.bucket, e.xid::text::bigint AS xid, e.seq, e.id, e.partition_key, e.topic, e.type,
       e.payload::text AS payload, e.headers::text AS headers, coalesce(e.occurred_at, e.created_at) AS time,
       e.idempotency_key, e.occurred_at, e.schema_version AS version
FROM outbox.events e
WHERE (%(key)s::text IS NULL
       OR (e.bucket = outbox.bucket_v1(%(key)s::text) AND e.partition_key = %(key)s::text))
  AND (%(type)s::text IS NULL OR e.type = %(type)s::text)
  AND (%(topic)s::text IS NULL OR e.topic = %(topic)s::text)
  AND (%(ids)s::text[] IS NULL OR e.id = ANY(%(ids)s::text[]::uuid[]))
ORDER BY e.xid, e.seq;
