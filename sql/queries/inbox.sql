-- Queries of the consumer-side inbox (outbox_relay.inbox); tables of sql/inbox/*.sql.

-- name: join
-- Register (or refresh) a run of a consumer process: its heartbeat keeps its share of the partitions.
-- Returns the run registered under this member id before when it was another one (a previous run
-- killed or crashed, or another live process given the same id): incarnation, host, pid, seconds since
-- it was heard from.
WITH before AS (
    SELECT incarnation, host, pid, extract(epoch FROM clock_timestamp() - heartbeat_at)::float8 AS silent
    FROM outbox_inbox.members
    WHERE consumer = %(consumer)s AND member = %(member)s
), joined AS (
    INSERT INTO outbox_inbox.members (consumer, member, host, pid, incarnation)
    VALUES (%(consumer)s, %(member)s, %(host)s, %(pid)s, %(incarnation)s)
    ON CONFLICT (consumer, member) DO UPDATE
        SET heartbeat_at = clock_timestamp(), host = excluded.host, pid = excluded.pid,
            incarnation = excluded.incarnation
)
SELECT incarnation, host, pid, silent FROM before WHERE incarnation IS DISTINCT FROM %(incarnation)s;

-- name: leave
-- A run of a consumer process that stops: its registration goes, the leases it claimed end now (not at
-- their expiry). Another run's under the same member id are left alone (they lapse: applied carefully).
WITH gone AS (
    DELETE FROM outbox_inbox.members
    WHERE consumer = %(consumer)s AND member = %(member)s AND incarnation = %(incarnation)s
)
UPDATE outbox_inbox.positions SET owner = NULL, lease_until = NULL, owner_incarnation = NULL
WHERE consumer = %(consumer)s AND owner = %(member)s AND owner_incarnation = %(incarnation)s;

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
-- Extend the leases this run of the process claimed; returns the ones it still holds (a missing one was
-- taken over). Not by member id alone: a previous run's under the same id are not this run's to renew.
UPDATE outbox_inbox.positions
SET lease_until = clock_timestamp() + make_interval(secs => %(lease)s)
WHERE consumer = %(consumer)s AND owner = %(member)s AND owner_incarnation = %(incarnation)s
  AND topic = ANY(%(topics)s)
RETURNING topic, partition, fence;

-- name: claim
-- Take up to `limit` partitions nobody holds (or whose lease expired), each with a new fence; and now,
-- whatever their lease says, those of `gone`: a previous run under this member id known to be dead.
WITH free AS (
    -- SKIP LOCKED: a row locked by an apply in flight (of a lease that lapsed) is taken next time.
    -- owner: a holder that stopped without releasing the lease (killed, crashed, cut off): lapsed.
    SELECT consumer, topic, partition, owner FROM outbox_inbox.positions
    WHERE consumer = %(consumer)s AND topic = ANY(%(topics)s)
      AND (owner IS NULL OR lease_until IS NULL OR lease_until < clock_timestamp()
           OR (owner = %(member)s AND owner_incarnation = %(gone)s))
    ORDER BY topic, partition
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_inbox.positions p
SET owner = %(member)s, owner_incarnation = %(incarnation)s, fence = p.fence + 1,
    lease_until = clock_timestamp() + make_interval(secs => %(lease)s)
FROM free
WHERE p.consumer = free.consumer AND p.topic = free.topic AND p.partition = free.partition
RETURNING p.topic, p.partition, p.fence, p.next_offset, p.last_message_id, free.owner IS NOT NULL AS lapsed,
          p.attempt_message_id, p.attempts, p.last_error;

-- name: release
-- Give one partition up (more than this process's share, or stopping); only while its fence is ours.
UPDATE outbox_inbox.positions SET owner = NULL, lease_until = NULL, owner_incarnation = NULL
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
-- Operator: per partition of a consumer, where it stands, who holds it and what happens to it now.
SELECT p.topic, p.partition, p.next_offset, p.owner, p.lease_until > clock_timestamp() AS leased,
       -- A live holder renews its lease every third of it, at its heartbeat: lease_until - heartbeat_at is
       -- about one lease; a holder not heard from for half of it missed a round.
       CASE WHEN p.owner IS NULL THEN 'free'
            WHEN p.lease_until IS NULL OR p.lease_until <= clock_timestamp() THEN 'lapsed'
            WHEN m.incarnation IS DISTINCT FROM p.owner_incarnation AND p.owner_incarnation IS NOT NULL
                THEN 'waiting for previous run'
            WHEN m.heartbeat_at IS NULL
                 OR clock_timestamp() - m.heartbeat_at > (p.lease_until - m.heartbeat_at) / 2 THEN 'silent'
            WHEN p.attempts > 0 THEN 'retrying'
            ELSE 'consuming' END AS state,
       CASE WHEN p.owner IS NULL THEN 'no process holds it; the next claim takes it'
            WHEN p.lease_until IS NULL OR p.lease_until <= clock_timestamp()
                THEN format('its holder stopped without releasing it %%ss ago; the next claim takes it and applies '
                            'its next message alone', round(extract(epoch FROM clock_timestamp() - p.lease_until)))
            WHEN m.incarnation IS DISTINCT FROM p.owner_incarnation AND p.owner_incarnation IS NOT NULL
                THEN format('held by a previous run of %%s that did not release it (killed, or still running '
                            'elsewhere with the same member id); claimable in %%ss',
                            p.owner, ceil(extract(epoch FROM p.lease_until - clock_timestamp())))
            WHEN m.heartbeat_at IS NULL
                 OR clock_timestamp() - m.heartbeat_at > (p.lease_until - m.heartbeat_at) / 2
                THEN format('its holder was not heard from for %%ss; claimable in %%ss unless it renews',
                            round(extract(epoch FROM clock_timestamp() - coalesce(m.heartbeat_at, p.updated_at))),
                            ceil(extract(epoch FROM p.lease_until - clock_timestamp())))
            WHEN p.attempts > 0 THEN format('its head message is at attempt %%s (last error: %%s)', p.attempts,
                                            left(p.last_error, 200))
            ELSE '' END AS detail,
       p.applied, p.duplicates, p.dead, p.updated_at
FROM outbox_inbox.positions p
LEFT JOIN outbox_inbox.members m ON m.consumer = p.consumer AND m.member = p.owner
WHERE p.consumer = %(consumer)s
ORDER BY p.topic, p.partition;
