-- name: lock_timeout
-- How long a partition change waits for the table's lock in this transaction (a long reader must not queue every producer behind it).
SELECT set_config('lock_timeout', %(ms)s::text, true);

-- name: add_partition
-- Create the next xid range partition of outbox.events if the newest one is half used (NULL: none needed).
SELECT outbox.add_partition_v1(%(min_width)s, %(seconds)s);

-- name: roll_partition
-- End the range being written at the next xid and start a new one (retention classes' current topics apply from it).
SELECT outbox.roll_partition_v1(%(min_width)s, %(seconds)s);

-- name: store_default_keep
-- The default class's keep that retention goes by (this relay's --retention-seconds), written only when it changed.
UPDATE outbox.housekeeping SET default_keep = make_interval(secs => %(retention)s)
WHERE default_keep IS DISTINCT FROM make_interval(secs => %(retention)s);

-- name: retire_partition
-- Drop the oldest leaf of outbox.events that every sink has passed and whose class's retention (by the stored keep) has elapsed (no row: none may go).
SELECT leaf, removed, newest FROM outbox.retire_partition_v2();

-- name: release_kept_events
-- Drop the copies of events (0015) that no parked row or dead letter names any more, with their idempotency keys.
SELECT outbox.release_kept_events_v1();

-- name: classes
-- Retention classes: keep (NULL: for good; default: the relays' --retention-seconds unless set) and topics.
WITH classes AS (
    -- The default class is there even without a row.
    SELECT 'default' AS name, NOT EXISTS (SELECT FROM outbox.retention_classes WHERE name = 'default') AS from_relays
    UNION
    SELECT name, false FROM outbox.retention_classes
)
SELECT c.name AS class,
       CASE WHEN k.forever THEN 'for good' ELSE justify_interval(k.keep)::text END AS keep,
       CASE WHEN NOT k.forever THEN extract(epoch FROM k.keep)::float8 END AS keep_seconds,
       c.from_relays AS keep_from_relays,
       CASE WHEN c.name = 'default' THEN NULL
            ELSE (SELECT array_agg(t.topic ORDER BY t.topic) FROM outbox.topic_retention t WHERE t.class = c.name)
       END AS topics
FROM classes c
CROSS JOIN LATERAL outbox.class_keep_v1(c.name, make_interval(secs => %(retention)s)) k
ORDER BY c.name <> 'default', c.name;

-- name: set_class
-- Create a retention class or change how long it keeps events (NULL: for good).
INSERT INTO outbox.retention_classes (name, keep)
VALUES (%(name)s, make_interval(secs => %(keep)s))
ON CONFLICT (name) DO UPDATE SET keep = EXCLUDED.keep, changed_at = clock_timestamp()
RETURNING name, keep;

-- name: reset_default
-- The default class keeps the relays' --retention-seconds again.
DELETE FROM outbox.retention_classes WHERE name = 'default' RETURNING name;

-- name: drop_class
-- Remove a class that no topic is mapped to and no partition holds.
DELETE FROM outbox.retention_classes r
WHERE r.name = %(name)s
  AND NOT EXISTS (SELECT FROM outbox.topic_retention t WHERE t.class = r.name)
  AND NOT EXISTS (SELECT FROM outbox.partitions p WHERE p.class = r.name)
RETURNING name;

-- name: map_topic
-- Put a topic's events in a class (from the next partition on).
INSERT INTO outbox.topic_retention (topic, class)
VALUES (%(topic)s, %(class)s)
ON CONFLICT (topic) DO UPDATE SET class = EXCLUDED.class, changed_at = clock_timestamp()
RETURNING topic, class;

-- name: unmap_topic
-- Return a topic's events to the default class (from the next partition on).
DELETE FROM outbox.topic_retention WHERE topic = %(topic)s RETURNING topic, class;

-- name: class_exists
-- Whether a retention class is defined ('default' always is).
SELECT %(name)s = 'default' OR EXISTS (SELECT FROM outbox.retention_classes WHERE name = %(name)s);

-- name: by_class
-- History per retention class: partitions, size, oldest event, and what holds its oldest partition (NULL: nothing; the next pass removes it). Mixed leaves (events_default, events_legacy) count as class '(all)'.
WITH leaves AS (
    -- Every leaf with its size and oldest event (index on created_at: one probe per leaf).
    SELECT p.name, coalesce(p.class, '(all)') AS class, p.xid_from,
           pg_total_relation_size(format('outbox.%%I', p.name)::regclass) AS bytes,
           outbox.partition_oldest_v1(p.name) AS oldest
    FROM outbox.partitions p
),
firsts AS (
    -- The oldest leaf of each class that holds events: what retention would remove next.
    SELECT DISTINCT ON (l.class) l.class, l.name
    FROM leaves l WHERE l.oldest IS NOT NULL
    ORDER BY l.class, l.xid_from NULLS FIRST, l.name
)
SELECT l.class, count(*) AS partitions, sum(l.bytes)::bigint AS bytes, min(l.oldest) AS oldest_event,
       (SELECT f.name FROM firsts f WHERE f.class = l.class) AS next_partition,
       (SELECT outbox.partition_hold_v1(f.name, make_interval(secs => %(retention)s))
        FROM firsts f WHERE f.class = l.class) AS held_by
FROM leaves l
GROUP BY l.class
ORDER BY l.class;

-- name: partitions
-- Every leaf of outbox.events: its range, class, topics, size, and what holds it (NULL: nothing).
SELECT p.name, p.range_name, coalesce(p.class, '(all)') AS class, p.topics, p.xid_from::text, p.xid_to::text,
       pg_total_relation_size(format('outbox.%%I', p.name)::regclass) AS bytes,
       outbox.partition_oldest_v1(p.name) AS oldest_event, p.created_at,
       outbox.partition_hold_v1(p.name, make_interval(secs => %(retention)s)) AS held_by
FROM outbox.partitions p
ORDER BY p.xid_from NULLS FIRST, p.name;
