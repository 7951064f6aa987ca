-- 0016_position_order_index: events_xid covers (xid, seq), the order events are delivered in.
--
-- A rebuild's bulk phase (projections/bulk.py, sql/queries/rebuild.sql bulk_read) reads stored
-- history in (xid, seq) order across all buckets, in slices that each start after the last event of
-- the one before. With an index on xid alone, a slice that starts inside a large transaction (a bulk
-- import, a backfill: hundreds of thousands of events under one xid) sorted all of that transaction's
-- events again at every slice, which made a rebuild quadratic in the size of its transactions. On
-- (xid, seq) each slice is one index range scan per xid partition, walked in xid order. The commit
-- probes of 0010 (outbox.watch_commits_v1: a range from an xmax, one probe per open id) use its first
-- column as before. Rebuilt on every partition while the table is locked (as 0014's indexes were).
DROP INDEX outbox.events_xid;
CREATE INDEX events_xid ON outbox.events (xid, seq);
