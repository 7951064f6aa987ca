-- name: prepare_session
-- Once per projection connection: the commit guard of migration 0006, and read-only transactions
-- unless begun READ WRITE (the relay begins its batches so), so that a handler that ends the
-- relay's transaction can neither commit the batch early nor autocommit what it writes after.
-- One row, updated by each batch: an UPDATE queues the trigger for the COMMIT, and a HOT update
-- keeps the table at one page (ON COMMIT DELETE ROWS would truncate a file at every commit,
-- which tripled the server's cost of a small batch).
CREATE TEMP TABLE outbox_projection_batch (token text NOT NULL);
INSERT INTO pg_temp.outbox_projection_batch VALUES ('');
CREATE CONSTRAINT TRIGGER outbox_projection_batch_guard
    AFTER UPDATE ON pg_temp.outbox_projection_batch DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION outbox.projection_batch_guard_v1();
SET default_transaction_read_only = on;

-- name: begin_batch
-- Settings of one projection transaction: a relay that stalls mid-transaction (paused,
-- partitioned) is cut off by the server after the lease, so its row locks never outlive it;
-- a rebuild resolves the projection's unqualified table names to its shadow schema first.
WITH guard AS (
    -- Arm the commit guard: this transaction commits only once end_batch vouched for the token.
    UPDATE pg_temp.outbox_projection_batch SET token = %(token)s
)
SELECT set_config('outbox_relay.batch', %(token)s, true),
       set_config('idle_in_transaction_session_timeout', %(idle_ms)s, true),
       CASE WHEN %(shadow)s::text IS NULL THEN NULL
            ELSE set_config('search_path', quote_ident(%(shadow)s) || ', ' || current_setting('search_path'), true)
       END;

-- name: end_batch
-- Right before the checkpoint: the batch is still in the transaction it began, which may now commit.
SELECT outbox.projection_batch_end_v1(%(token)s);

-- name: event_savepoint
-- Before each event of the careful walk: its writes can be undone alone.
SAVEPOINT outbox_event;

-- name: event_release
-- The event's handler returned: keep its writes.
RELEASE SAVEPOINT outbox_event;

-- name: event_rollback
-- The event failed: undo its writes, the batch's transaction goes on.
ROLLBACK TO SAVEPOINT outbox_event;
RELEASE SAVEPOINT outbox_event;

-- name: writes_outside_shadow
-- The tables this transaction wrote outside a rebuild's shadow schema (a rebuild must write only
-- its copies: anything else gets its writes on top of live processing). A write holds a lock on
-- its table until the transaction ends (or its savepoint is undone): DML a ROW EXCLUSIVE one,
-- TRUNCATE and DDL stronger ones. Temporary tables, sequences, indexes and the system catalogs
-- (which any DDL, a temporary table's too, writes) do not count.
SELECT DISTINCT quote_ident(n.nspname) || '.' || quote_ident(c.relname)
FROM pg_locks l
JOIN pg_class c ON c.oid = l.relation
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation' AND l.granted
  AND l.mode IN ('RowExclusiveLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')
  AND c.relkind IN ('r', 'p', 'f', 'm')
  AND c.relpersistence <> 't'
  AND n.nspname NOT IN (%(shadow)s, 'pg_catalog', 'information_schema')
ORDER BY 1;

-- name: end_walk
-- End the transaction of a batch walk the relay abandoned (a handler that never returned), on a
-- connection of its own: its row locks and the vacuum horizon go, nothing of it can commit. Waits
-- up to wait_ms for the backend to exit; false if it did not.
SELECT pg_terminate_backend(%(pid)s, %(wait_ms)s);
