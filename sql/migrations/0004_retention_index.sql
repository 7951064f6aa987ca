-- 0004_retention_index: find old events with a B-tree on created_at instead of BRIN.
--
-- Retention deletes the oldest events first. With BRIN and its cutoff computed inside the
-- query, every pass scanned the whole table (118 ms for 1M events, growing with history), and
-- the last slice of a pass held its writing transaction, hence every relay's read horizon, for
-- the whole scan. With a B-tree the oldest rows are found at once and a pass with nothing to
-- delete is one index probe. Time-based replays and rebuilds use it too. Inserts pay one more
-- B-tree entry, at the right edge of the index (created_at grows with time).
DROP INDEX outbox.events_created_at;
CREATE INDEX events_created_at ON outbox.events (created_at);

-- Retention asks, per old event, whether every sink's cursor of its bucket has passed it. The
-- bucket never changes, so this index keeps the cursors' once-per-batch updates HOT.
CREATE INDEX cursors_bucket ON outbox.cursors (bucket);
-- Likewise whether any sink has the event parked (a failing sink can park many).
CREATE INDEX parked_position ON outbox.parked (bucket, xid, seq);
