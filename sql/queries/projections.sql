-- name: begin_batch
-- Settings of one projection transaction: a relay that stalls mid-transaction (paused,
-- partitioned) is cut off by the server after the lease, so its row locks never outlive it;
-- a rebuild resolves the projection's unqualified table names to its shadow schema first.
SELECT set_config('idle_in_transaction_session_timeout', %(idle_ms)s, true),
       CASE WHEN %(shadow)s::text IS NULL THEN NULL
            ELSE set_config('search_path', quote_ident(%(shadow)s) || ', ' || current_setting('search_path'), true)
       END;

-- name: live_table_writes
-- Rows this transaction wrote to the given tables (a rebuild must write only its shadow copies).
SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint
FROM pg_stat_xact_user_tables
WHERE relid = ANY(%(tables)s::oid[]);
