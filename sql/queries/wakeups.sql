-- name: lead
-- Become the relay that watches for commits, unless another one is: a session-level advisory lock on the LISTEN connection, freed the moment that connection ends.
SELECT pg_try_advisory_lock(%(lock)s::bigint);

-- name: step_down
-- Stop watching for commits (a draining relay), so that another relay takes over at its next try.
SELECT pg_advisory_unlock(%(lock)s::bigint);

-- name: watch
-- Wait up to wait_ms for transactions that wrote events to commit since the last look (outbox.watch_commits_v1, which also notifies outbox_events_v2 with their buckets).
SELECT snapshot::text, buckets FROM outbox.watch_commits_v1(%(since)s::pg_snapshot, %(wait_ms)s::int, %(interval_ms)s::float8);

-- name: timeout_ms
-- The smallest statement or transaction time limit of this session in milliseconds (0: none): a watch waits at most half of it.
SELECT least(nullif(extract(epoch FROM current_setting('statement_timeout')::interval) * 1000, 0),
             nullif(extract(epoch FROM coalesce(current_setting('transaction_timeout', true), '0')::interval) * 1000, 0))::bigint;
