-- name: insert_plain
-- Append one event the library made in its usual shape (a new id; no headers, no time, version 1), with or without an idempotency key: a plain INSERT, the cheapest write a producer can make.
-- Nothing to check in the table: a new UUIDv7 collides with no stored id. With a key, events_check
-- records it in outbox.idempotency_keys, or skips the row when the key is taken (0014): the row count
-- (no RETURNING: its row description and row cost every call) tells the caller, who then looks the
-- stored event up (find_by_idempotency_keys). Only the fields that differ from the column defaults
-- are sent; every parameter is text, so that any DB-API driver can bind it.
INSERT INTO outbox.events (id, topic, partition_key, type, payload, idempotency_key)
VALUES (%(id)s::uuid, %(topic)s, %(key)s, %(type)s, %(payload)s::jsonb, %(idempotency_key)s);

-- name: insert_one
-- Append one event the library made with every field (headers, time or a version other than 1), with or without an idempotency key; as insert_plain otherwise.
INSERT INTO outbox.events (id, topic, partition_key, type, payload, headers, idempotency_key, occurred_at,
                           schema_version)
VALUES (%(id)s::uuid, %(topic)s, %(key)s, %(type)s, %(payload)s::jsonb, %(headers)s::jsonb, %(idempotency_key)s,
        %(time)s::timestamptz, %(version)s::int);

-- name: insert_many
-- Append events the library made (new ids, no idempotency keys) in one statement; positions (seq) follow the caller's order.
-- The batch is one JSON array of rows (Outbox._batch_json): psycopg escapes every quote of a text
-- array's elements in Python, a third of publish_many's time per event; one text parameter is
-- passed as it is. A JSON null payload arrives as SQL NULL and is stored as the JSON null it was.
INSERT INTO outbox.events (id, topic, partition_key, type, payload, headers, occurred_at, schema_version)
SELECT r.id, r.topic, r.key, r.type, coalesce(r.payload, 'null'::jsonb), r.headers, r.time, r.version
FROM ROWS FROM (jsonb_to_recordset(%(rows)s::jsonb)
                AS (id uuid, topic text, key text, type text, payload jsonb, headers jsonb, time timestamptz,
                    version integer))
     WITH ORDINALITY AS r(id, topic, key, type, payload, headers, time, version, ord)
ORDER BY r.ord;

-- name: insert_checked
-- Append events whose ids the caller chose (Event objects, no idempotency keys): all of them, or none if one of the ids is already stored, so that the caller's transaction stays usable.
WITH input AS (
    -- One row per event, in the caller's order.
    SELECT i.id::uuid AS id, i.topic, i.partition_key, i.type, i.payload::jsonb AS payload,
           i.headers::jsonb AS headers, i.occurred_at::timestamptz AS occurred_at, i.schema_version, i.ord
    FROM unnest(
        %(ids)s::text[], %(topics)s::text[], %(keys)s::text[], %(types)s::text[],
        %(payloads)s::text[], %(headers)s::text[], %(times)s::text[], %(versions)s::int[]
    ) WITH ORDINALITY AS i(id, topic, partition_key, type, payload, headers, occurred_at, schema_version, ord)
)
-- One primary-key probe per event; a stored id makes the statement insert nothing.
INSERT INTO outbox.events (id, topic, partition_key, type, payload, headers, occurred_at, schema_version)
SELECT id, topic, partition_key, type, payload, headers, occurred_at, schema_version
FROM input
WHERE NOT EXISTS (SELECT FROM outbox.events e WHERE e.id IN (SELECT id FROM input))
ORDER BY ord
RETURNING id;

-- name: stored_ids
-- Which of these ids are stored already (naming the one insert_checked refused).
SELECT id FROM outbox.events WHERE id = ANY(%(ids)s::uuid[]);

-- name: publish
-- Append a batch of events with idempotency keys in one round trip; a repeated idempotency key yields the existing event, and a key that stands for another event makes the batch insert nothing.
-- The batch is one JSON array of rows, as in insert_many (Outbox._batch_json): one text parameter any
-- DB-API driver binds as it is (a text array's elements are escaped in Python: 12 ms per 1,000 payloads).
-- No step joins two CTEs: the planner knows nothing of their columns and would multiply row
-- estimates until the cost passes jit_above_cost (JIT compiling took 0.3-7 s per batch on PG 15).
WITH input AS (
    -- One row per event, in the caller's order, each value cast once; with an idempotency key, how
    -- many events of the batch use it, and the first of them (the one inserted, if any is: the later
    -- ones conflict with it).
    SELECT c.*, count(*) OVER same_key AS uses, first_value(c.id) OVER same_key AS first_id
    FROM (
        -- A JSON null payload arrives as SQL NULL: stored as the JSON null it was.
        SELECT i.id, i.topic, i.partition_key, i.type, coalesce(i.payload, 'null'::jsonb) AS payload, i.headers,
               i.idempotency_key, i.occurred_at, i.schema_version, i.ord
        FROM ROWS FROM (jsonb_to_recordset(%(rows)s::jsonb)
                        AS (id uuid, topic text, key text, type text, payload jsonb, headers jsonb,
                            idempotency_key text, time timestamptz, version integer))
             WITH ORDINALITY AS i(id, topic, partition_key, type, payload, headers, idempotency_key, occurred_at,
                                  schema_version, ord)
    ) c
    WINDOW same_key AS (PARTITION BY coalesce(c.topic, ''), c.idempotency_key ORDER BY c.ord
                        ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)
),
shared AS (
    -- Idempotency keys this batch uses for more than one event (type, key or payload differ);
    -- fingerprints are computed only for keys used more than once.
    SELECT coalesce(topic, '') AS scope, idempotency_key
    FROM input
    WHERE idempotency_key IS NOT NULL AND uses > 1
    GROUP BY 1, 2
    HAVING count(DISTINCT outbox.fingerprint_v1(type, partition_key, payload)) > 1
),
checked AS (
    -- Each input with the stored event under its idempotency key that this statement can see, and
    -- whether that one stands for another event (one stored before migration 0005 has no
    -- fingerprint and counts as the same). LATERAL ... LIMIT 1 is one index probe per key, where a
    -- join may be planned as a scan and sort of the whole table.
    SELECT i.*, old.id AS known_id,
           -- Fingerprinted only against a stored key (a sha256 per event otherwise: a third of a batch's time).
           CASE WHEN old.id IS NOT NULL
                THEN old.idempotency_fingerprint <> outbox.fingerprint_v1(i.type, i.partition_key, i.payload)
           END AS known_differs
    FROM input i
    LEFT JOIN LATERAL (
        SELECT k.event_id AS id, k.fingerprint AS idempotency_fingerprint
        FROM outbox.idempotency_keys k
        WHERE i.idempotency_key IS NOT NULL
          AND k.scope = coalesce(i.topic, '') AND k.key = i.idempotency_key
        LIMIT 1
    ) old ON true
),
conflicts AS (
    -- Inputs whose idempotency key stands for another event: a stored one, or one in this batch.
    SELECT ord
    FROM checked
    WHERE known_differs
       OR (uses > 1 AND (coalesce(topic, ''), idempotency_key) IN (SELECT scope, idempotency_key FROM shared))
),
taken AS (
    -- Inputs whose id a stored event has, other than the stored event its idempotency key stands for
    -- (a retry of the same event): inserting them would fail on the primary key and abort the
    -- caller's transaction. One primary-key probe per input; none when the caller made every id just
    -- now (new UUIDv7s: nothing stored has them).
    SELECT c.ord
    FROM checked c
    WHERE NOT %(ids_new)s::boolean AND c.known_id IS DISTINCT FROM c.id
      AND EXISTS (SELECT FROM outbox.events e WHERE e.id = c.id)
),
inserted AS (
    -- Positions (seq) follow the caller's order; a known idempotency key inserts nothing (events_check
    -- skips the row: 0014), and one conflict or taken id inserts nothing at all, so the caller's
    -- transaction holds none of the batch and stays usable.
    INSERT INTO outbox.events (id, topic, partition_key, type, payload, headers, idempotency_key, occurred_at,
                               schema_version)
    SELECT id, topic, partition_key, type, payload, headers, idempotency_key, occurred_at, schema_version
    FROM checked
    WHERE NOT EXISTS (SELECT FROM conflicts) AND NOT EXISTS (SELECT FROM taken)
    ORDER BY ord
    RETURNING id
)
-- For each input row: the event that stands for it (this row's, the batch's first under its key,
-- or the stored one), whether this call created it, and whether its key conflicts. id NULL: the
-- stored one committed after this statement's snapshot was taken (find_by_idempotency_keys).
SELECT CASE WHEN i.id IN (SELECT id FROM inserted) THEN i.id
            WHEN i.idempotency_key IS NOT NULL AND i.first_id IN (SELECT id FROM inserted) THEN i.first_id
            ELSE i.known_id END AS id,
       i.id IN (SELECT id FROM inserted) AS created,
       i.ord IN (SELECT ord FROM conflicts) AS conflict,
       i.ord IN (SELECT ord FROM taken) AS id_taken
FROM checked i
ORDER BY i.ord;

-- name: find_by_idempotency_keys
-- Resolve keys whose stored event committed after the publish statement took its snapshot: its id, and whether it stands for the same event.
-- An event stored before migration 0005 has no fingerprint and counts as the same. id NULL: no stored event (retention removed it meanwhile).
SELECT e.id, e.idempotency_fingerprint IS NULL
             OR e.idempotency_fingerprint = outbox.fingerprint_v1(k.type, k.partition_key, k.payload::jsonb) AS same
FROM unnest(%(topics)s::text[], %(idempotency_keys)s::text[], %(types)s::text[], %(keys)s::text[],
            %(payloads)s::text[]) WITH ORDINALITY AS k(topic, idempotency_key, type, partition_key, payload, ord)
LEFT JOIN LATERAL (
    -- One index probe per key (see checked in publish).
    SELECT s.event_id AS id, s.fingerprint AS idempotency_fingerprint
    FROM outbox.idempotency_keys s
    WHERE s.scope = coalesce(k.topic, '') AND s.key = k.idempotency_key
    LIMIT 1
) e ON true
ORDER BY k.ord;

-- name: abort_transaction
-- Fail the caller's transaction: a batch was partly written when a concurrent transaction's event under one of its idempotency keys turned out to differ, and that part must never commit.
DO $$
BEGIN
    RAISE EXCEPTION 'outbox-relay: an idempotency key of this publish call stands for another event, stored by a concurrent transaction; the rest of the call was written, so this transaction must be rolled back'
        USING ERRCODE = 'unique_violation';
END
$$;
