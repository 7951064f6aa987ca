-- 0023_console_audit: what the operator console (outbox-relay console) keeps in the database.
--
-- console_audit: every action an operator took in the console (retry, skip, pause, resume a key; retry
-- or discard dead letters), who (the token's label, or the operator name given at sign-in), when, what
-- (the sink, the key, the event ids or the filter) and how many events it changed; refused actions too,
-- with the reason. Written in the action's own transaction, so an action that committed has its record.
-- Read newest first by id (the primary key); never updated by the product.
--
-- console_samples: one row per sink and minute (backlog, parked, dead letters, events published that
-- minute), written by a running console once a minute and kept for a day, so that the overview draws the
-- last hour's backlog and throughput from the database alone (no Prometheus). A few thousand rows a day
-- for a deployment's sinks; the primary key is the overview's read (a sink's last 60 minutes) and the
-- index on at the day's trim.
--
-- dead_letters_newest: a sink's dead letters newest first without sorting them all.

CREATE TABLE outbox.console_audit (
    id          bigint      GENERATED ALWAYS AS IDENTITY,
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    who         text        NOT NULL,
    -- The database role the console ran as.
    role        text        NOT NULL DEFAULT session_user,
    action      text        NOT NULL,
    sink        text,
    target      text        NOT NULL,
    count       integer     NOT NULL DEFAULT 0,
    -- NULL: done; else why it was refused.
    refused     text,
    CONSTRAINT console_audit_pkey PRIMARY KEY (id)
);

CREATE TABLE outbox.console_samples (
    sink         text        NOT NULL,
    at           timestamptz NOT NULL,
    pending      bigint      NOT NULL,
    parked       bigint      NOT NULL,
    dead_letters bigint      NOT NULL,
    published    bigint      NOT NULL,
    CONSTRAINT console_samples_pkey PRIMARY KEY (sink, at)
);

CREATE INDEX console_samples_at ON outbox.console_samples (at, sink);

-- A sink's dead letters newest first (the console's and `dead-letters list`'s page): an index range read
-- backwards, not a sort of every dead letter of the sink (10,000 of them in the console's bench).
CREATE INDEX dead_letters_newest ON outbox.dead_letters (sink, dead_at, event_id);
