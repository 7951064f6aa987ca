-- The consumer-side inbox (outbox_relay.inbox), in its own schema: a consuming service's database
-- usually has no outbox schema, and needs none. Applied by `outbox-relay inbox migrate`.

CREATE SCHEMA IF NOT EXISTS outbox_inbox;

-- Consumer processes that are alive, per consumer name; partitions are shared evenly among them.
CREATE TABLE outbox_inbox.members (
    consumer     text        NOT NULL CHECK (consumer ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}$'),
    member       text        NOT NULL,
    host         text,
    pid          integer,
    heartbeat_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (consumer, member)
);

-- Per consumed partition: the next offset to apply (moved in each message's own transaction), and
-- the lease that lets one process at a time consume it (owner, lease_until, fence: a takeover bumps
-- the fence, and an apply whose fence is stale affects nothing).
CREATE TABLE outbox_inbox.positions (
    consumer    text        NOT NULL,
    topic       text        NOT NULL,
    partition   integer     NOT NULL CHECK (partition >= 0),
    next_offset bigint      CHECK (next_offset >= 0),  -- NULL: nothing applied yet
    last_message_id text,  -- the id of the message at next_offset - 1: tells a log that went back (broker amnesia)
    owner       text,
    fence       bigint      NOT NULL DEFAULT 0,
    lease_until timestamptz,
    applied     bigint      NOT NULL DEFAULT 0,  -- messages whose handler ran
    duplicates  bigint      NOT NULL DEFAULT 0,  -- messages skipped: their ce_id was applied before
    dead        bigint      NOT NULL DEFAULT 0,  -- messages moved to dead letters
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (consumer, topic, partition)
);

-- The dedupe record: one row per applied message id (ce_id), written in the handler's transaction.
CREATE TABLE outbox_inbox.messages (
    consumer   text        NOT NULL,
    message_id text        NOT NULL,
    topic      text        NOT NULL,
    partition  integer     NOT NULL,
    "offset"   bigint      NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (consumer, message_id)
);
-- Retention deletes the oldest records of a consumer in bounded batches.
CREATE INDEX messages_retention ON outbox_inbox.messages (consumer, applied_at);

-- Messages whose handler kept failing, kept whole so that they can be applied again.
CREATE TABLE outbox_inbox.dead_letters (
    id                 bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer           text        NOT NULL,
    message_id         text        NOT NULL,
    topic              text        NOT NULL,
    partition          integer     NOT NULL,
    "offset"           bigint      NOT NULL,
    key                bytea,
    value              bytea,
    header_names       text[]      NOT NULL DEFAULT '{}',
    header_values      bytea[]     NOT NULL DEFAULT '{}',
    message_time       timestamptz,
    attempts           integer     NOT NULL,
    error              text        NOT NULL,
    dead_at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    retry_requested_at timestamptz  -- set by `inbox dead-letters retry`; a running consumer applies it
);
CREATE INDEX dead_letters_list ON outbox_inbox.dead_letters (consumer, dead_at DESC, id DESC);
CREATE INDEX dead_letters_retry ON outbox_inbox.dead_letters (consumer, id) WHERE retry_requested_at IS NOT NULL;
