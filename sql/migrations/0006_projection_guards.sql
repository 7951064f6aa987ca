-- 0006_projection_guards: a projection handler can not end the relay's transaction.
--
-- Why: a projection's writes must commit together with its fenced checkpoint (G7). A handler that
-- ran tx.execute('COMMIT') (or END) committed what the batch had written so far without the
-- checkpoint, and the batch, failed or redone, applied it again: effects landed two or three
-- times. A ROLLBACK let the statements after it autocommit on their own.
--
-- How: each projection connection creates a one-row temporary table with a deferred constraint
-- trigger that calls projection_batch_guard_v1 at COMMIT (sql/queries/projections.sql,
-- prepare_session). Every batch first writes its token into that row; the trigger refuses the
-- COMMIT unless projection_batch_end_v1, which the relay runs right before its checkpoint, vouched
-- for that token in the same transaction. So a handler's early COMMIT fails at the server and rolls everything
-- back. The connection's transactions are read-only unless begun READ WRITE (only the relay's
-- batches are), so after a ROLLBACK nothing can autocommit either. Older code never calls these
-- functions: no min-code-version.

-- Deferred constraint trigger on a projection connection's pg_temp.outbox_projection_batch (one row,
-- updated by every batch): the transaction commits only if projection_batch_end_v1 ran in it for
-- the batch's token.
CREATE FUNCTION outbox.projection_batch_guard_v1() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox_relay.batch_end', true) IS DISTINCT FROM NEW.token THEN
        RAISE EXCEPTION 'a projection handler ended the relay''s transaction (COMMIT or END) before its checkpoint; '
                        'nothing of the batch is kept'
            USING ERRCODE = 'invalid_transaction_termination',
                  HINT = 'a handler writes through the transaction it is given and never commits or rolls it back';
    END IF;
    RETURN NULL;
END
$$;

-- Run by the relay right before a projection batch's checkpoint: the batch is still in the
-- transaction it began (the token is transaction-local), and may now commit.
CREATE FUNCTION outbox.projection_batch_end_v1(token text) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox_relay.batch', true) IS DISTINCT FROM token THEN
        RAISE EXCEPTION 'the projection batch is no longer in the transaction it began (a handler ran COMMIT, END or '
                        'ROLLBACK); nothing of the batch is kept'
            USING ERRCODE = 'invalid_transaction_termination';
    END IF;
    PERFORM set_config('outbox_relay.batch_end', token, true);
END
$$;
