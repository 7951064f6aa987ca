-- Queries of the consumer-side inbox (outbox_relay.inbox); tables of sql/inbox/*.sql.

-- name: join
-- Register (or refresh) a consumer process: its heartbeat keeps its share of the partitions.
INSERT INTO outbox_inbox.members (consumer, member, host, pid)
VALUES (%(consumer)s, %(member)s, %(host)s, %(pid)s)
ON CONFLICT (consumer, member) DO UPDATE SET heartbeat_at = clock_timestamp(), host = excluded.host, pid = excluded.pid;

-- name: leave
-- A consumer process that stops: its registration goes, its leases end now (not at their expiry).
WITH gone AS (
    DELETE FROM outbox_inbox.members WHERE consumer = %(consumer)s AND member = %(member)s
)
UPDATE outbox_inbox.positions SET owner = NULL, lease_until = NULL
WHERE consumer = %(consumer)s AND owner = %(member)s;

-- name: live_members
-- How many processes of the consumer are alive (heard from within the time to live).
SELECT count(*) FROM outbox_inbox.members
WHERE consumer = %(consumer)s AND heartbeat_at > clock_timestamp() - make_interval(secs => %(ttl)s);

-- name: add_partitions
-- Positions for partitions seen for the first time (nothing applied yet: next_offset NULL).
INSERT INTO outbox_inbox.positions (consumer, topic, partition)
SELECT %(consumer)s, t, p FROM unnest(%(topics)s::text[], %(partitions)s::int[]) AS x (t, p)
ON CONFLICT DO NOTHING;

-- name: renew
-- Extend this process's leases; returns the ones it still holds (a missing one was taken over).
UPDATE outbox_inbox.positions
SET lease_until = clock_timestamp() + make_interval(secs => %(lease)s)
WHERE consumer = %(consumer)s AND owner = %(member)s AND topic = ANY(%(topics)s)
RETURNING topic, partition, fence;

-- name: claim
-- Take up to `limit` partitions nobody holds (or whose lease expired), each with a new fence.
WITH free AS (
    -- SKIP LOCKED: a row locked by an apply in flight (of a lease that lapsed) is taken next time.
    -- owner: a holder that stopped without releasing the lease (killed, crashed, cut off): lapsed.
    SELECT consumer, topic, partition, owner FROM outbox_inbox.positions
    WHERE consumer = %(consumer)s AND topic = ANY(%(topics)s)
      AND (owner IS NULL OR lease_until IS NULL OR lease_until < clock_timestamp())
    ORDER BY topic, partition
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_inbox.positions p
SET owner = %(member)s, fence = p.fence + 1, lease_until = clock_timestamp() + make_interval(secs => %(lease)s)
FROM free
WHERE p.consumer = free.consumer AND p.topic = free.topic AND p.partition = free.partition
RETURNING p.topic, p.partition, p.fence, p.next_offset, p.last_message_id, free.owner IS NOT NULL AS lapsed,
          p.attempt_message_id, p.attempts, p.last_error;

-- name: release
-- Give one partition up (more than this process's share, or stopping); only while its fence is ours.
UPDATE outbox_inbox.positions SET owner = NULL, lease_until = NULL
WHERE consumer = %(consumer)s AND topic = %(topic)s AND partition = %(partition)s
  AND owner = %(member)s AND fence = %(fence)s;

-- name: lock_position
-- First statement of a message's transaction: the partition is still ours (fence), and it stays so
-- until commit (the row lock makes a takeover wait for this transaction).
SELECT next_offset FROM outbox_inbox.positions
WHERE consumer = %(consumer)s AND topic = %(topic)s AND partition = %(partition)s
  AND owner = %(member)s AND fence = %(fence)s
FOR UPDATE;

-- name: record_message
-- The dedupe record; no row back: this message id was applied before (a duplicate).
INSERT INTO outbox_inbox.messages (consumer, message_id, topic, partition, "offset")
VALUES (%(consumer)s, %(message_id)s, %(topic)s, %(partition)s, %(offset)s)
ON CONFLICT DO NOTHING
RETURNING 1;

-- name: record_messages
-- The dedupe records of a batch of one partition; returns the ids inserted (the others are duplicates).
INSERT INTO outbox_inbox.messages (consumer, message_id, topic, partition, "offset")
SELECT %(consumer)s, id, %(topic)s, %(partition)s, o FROM unnest(%(ids)s::text[], %(offsets)s::bigint[]) AS x (id, o)
ON CONFLICT DO NOTHING
RETURNING message_id;

-- name: advance
-- The partition's next offset and counters, in the message's transaction (row locked by lock_position);
-- the attempts of the head message end with it: a batch starts at the head, so `first_id` is its id when
-- it is in the batch (applied, skipped or dead-lettered now).
UPDATE outbox_inbox.positions
SET next_offset = %(next_offset)s, last_message_id = %(message_id)s, applied = applied + %(applied)s,
    duplicates = duplicates + %(duplicates)s, dead = dead + %(dead)s, updated_at = clock_timestamp(),
    attempt_message_id = CASE WHEN attempt_message_id = %(first_id)s THEN NULL ELSE attempt_message_id END,
    attempts = CASE WHEN attempt_message_id = %(first_id)s THEN 0 ELSE attempts END,
    last_error = CASE WHEN attempt_message_id = %(first_id)s THEN NULL ELSE last_error END
WHERE consumer = %(consumer)s AND topic = %(topic)s AND partition = %(partition)s;

-- name: record_attempt
-- Before an attempt made alone, committed on its own: the head message's attempts so far, counting this
-- one, with the error that stands if the process dies during it. Only while the lease is ours.
UPDATE outbox_inbox.positions
SET attempt_message_id = %(message_id)s, attempts = %(attempts)s, last_error = %(error)s
WHERE consumer = %(consumer)s AND topic = %(topic)s AND partition = %(partition)s
  AND owner = %(member)s AND fence = %(fence)s
RETURNING attempts;

-- name: attempt_failed
-- An attempt recorded by record_attempt raised: its error replaces "the process stopped".
UPDATE outbox_inbox.positions SET last_error = %(error)s
WHERE consumer = %(consumer)s AND topic = %(topic)s AND partition = %(partition)s
  AND owner = %(member)s AND fence = %(fence)s AND attempt_message_id = %(message_id)s;

-- name: add_dead_letter
-- A message whose handler kept failing, kept whole (the position moves past it in the same transaction).
INSERT INTO outbox_inbox.dead_letters (consumer, message_id, topic, partition, "offset", key, value, header_names,
                                       header_values, message_time, attempts, error)
VALUES (%(consumer)s, %(message_id)s, %(topic)s, %(partition)s, %(offset)s, %(key)s, %(value)s, %(header_names)s,
        %(header_values)s, %(message_time)s, %(attempts)s, %(error)s);

-- name: take_dead_letter
-- The oldest dead letter an operator asked to retry, taken by one consumer (SKIP LOCKED) and committed
-- before its handler runs: the request is used up and the attempt counted with the error that stands
-- if the process dies during it, so a dead letter that kills its consumer is not retried at every start.
WITH due AS (
    SELECT id FROM outbox_inbox.dead_letters
    WHERE consumer = %(consumer)s AND retry_requested_at IS NOT NULL
    ORDER BY id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_inbox.dead_letters d
SET retry_requested_at = NULL, attempts = d.attempts + 1, error = %(error)s, dead_at = clock_timestamp()
FROM due
WHERE d.id = due.id
RETURNING d.id, d.message_id, d.topic, d.partition, d."offset", d.key, d.value, d.header_names, d.header_values,
          d.message_time, d.attempts;

-- name: delete_dead_letter
-- First statement of a retried dead letter's transaction: it goes with the apply; no row back: an
-- operator dropped it meanwhile, or another retry of it committed (the row lock makes this one wait).
DELETE FROM outbox_inbox.dead_letters WHERE id = %(id)s
RETURNING id;

-- name: retry_failed
-- A retried dead letter that failed again (its attempt counted by take_dead_letter): it stays, with its
-- new error, until asked again.
UPDATE outbox_inbox.dead_letters SET error = %(error)s WHERE id = %(id)s;

-- name: delete_old_messages
-- Retention: one bounded batch of dedupe records older than the cutoff (oldest first).
DELETE FROM outbox_inbox.messages m
USING (
    SELECT consumer, message_id FROM outbox_inbox.messages
    WHERE consumer = %(consumer)s AND applied_at < clock_timestamp() - make_interval(secs => %(retention)s)
    ORDER BY applied_at
    LIMIT %(batch)s
) old
WHERE m.consumer = old.consumer AND m.message_id = old.message_id;

-- name: delete_stale_members
-- Registrations not heard from for ten times their time to live (crashed processes).
DELETE FROM outbox_inbox.members
WHERE consumer = %(consumer)s AND heartbeat_at < clock_timestamp() - make_interval(secs => %(ttl)s * 10);

-- name: list_dead_letters
-- Operator: dead letters of a consumer, newest first, one page (after the id given).
SELECT id, topic, partition, "offset", message_id, attempts, dead_at, retry_requested_at IS NOT NULL AS retry_requested,
       left(error, 200) AS error
FROM outbox_inbox.dead_letters
WHERE consumer = %(consumer)s AND (%(topic)s::text IS NULL OR topic = %(topic)s)
  AND (%(after)s::bigint IS NULL OR id < %(after)s)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: show_dead_letter
-- Operator: one dead letter whole.
SELECT id, consumer, message_id, topic, partition, "offset", key, value, header_names, header_values, message_time,
       attempts, error, dead_at, retry_requested_at
FROM outbox_inbox.dead_letters
WHERE consumer = %(consumer)s AND id = %(id)s;

-- name: request_retry
-- Operator: ask the running consumers to apply these dead letters again (all of the consumer's when ids is NULL).
UPDATE outbox_inbox.dead_letters SET retry_requested_at = clock_timestamp()
WHERE consumer = %(consumer)s AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s))
RETURNING id;

-- name: drop_dead_letters
-- Operator: delete dead letters for good (all of the consumer's when ids is NULL).
DELETE FROM outbox_inbox.dead_letters
WHERE consumer = %(consumer)s AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s))
RETURNING id;

-- name: positions
-- Operator: per partition of a consumer, where it stands and who holds it.
SELECT topic, partition, next_offset, owner, lease_until > clock_timestamp() AS leased, applied, duplicates, dead,
       updated_at
FROM outbox_inbox.positions
WHERE consumer = %(consumer)s
ORDER BY topic, partition;
