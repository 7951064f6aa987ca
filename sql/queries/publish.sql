-- name: publish
-- Append a batch of events in one round trip; a repeated idempotency key yields the existing event.
-- Every parameter is a text array so that any DB-API driver (psycopg, psycopg2 via SQLAlchemy) can bind it.
WITH input AS (
    -- One row per event, in the caller's order.
    SELECT *
    FROM unnest(
        %(ids)s::text[], %(topics)s::text[], %(keys)s::text[], %(types)s::text[],
        %(payloads)s::text[], %(headers)s::text[], %(idempotency_keys)s::text[], %(times)s::text[]
    ) WITH ORDINALITY AS i(id, topic, partition_key, type, payload, headers, idempotency_key, occurred_at, ord)
),
inserted AS (
    -- Positions (seq) follow the caller's order; a known idempotency key inserts nothing.
    INSERT INTO outbox.events (id, topic, partition_key, type, payload, headers, idempotency_key, occurred_at)
    SELECT id::uuid, topic, partition_key, type, payload::jsonb, headers::jsonb, idempotency_key,
           occurred_at::timestamptz
    FROM input
    ORDER BY ord
    ON CONFLICT ((coalesce(topic, '')), idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, topic, idempotency_key
)
-- For each input row: the event that stands for it, and whether this call created it.
-- A duplicate maps to a row inserted earlier in this batch, else to the stored one.
SELECT coalesce(n.id, dup.id, old.id) AS id, n.id IS NOT NULL AS created
FROM input i
LEFT JOIN inserted n ON n.id = i.id::uuid
LEFT JOIN inserted dup ON n.id IS NULL AND dup.idempotency_key = i.idempotency_key
                       AND coalesce(dup.topic, '') = coalesce(i.topic, '')
LEFT JOIN outbox.events old ON n.id IS NULL AND dup.id IS NULL AND old.idempotency_key = i.idempotency_key
                           AND coalesce(old.topic, '') = coalesce(i.topic, '')
ORDER BY i.ord;

-- name: find_by_idempotency_keys
-- Resolve duplicates whose original committed after the publish statement took its snapshot.
SELECT coalesce(e.topic, ''), e.idempotency_key, e.id
FROM unnest(%(topics)s::text[], %(idempotency_keys)s::text[]) AS k(topic, idempotency_key)
JOIN outbox.events e ON coalesce(e.topic, '') = coalesce(k.topic, '') AND e.idempotency_key = k.idempotency_key;
