-- 0017_position_order_index: events_xid also orders by seq within a transaction, for a rebuild's reads only.
--
-- A rebuild's bulk phase (projections/bulk.py, sql/queries/rebuild.sql bulk_read) reads stored history in
-- (xid, seq) order across all buckets, in slices that each start after the last event of the one before.
-- With an index on xid alone, a slice that starts inside a large transaction (a bulk import, a backfill:
-- hundreds of thousands of events under one xid) read and sorted the rest of that transaction at every
-- slice: a rebuild quadratic in the size of its transactions. Now each slice is one index range scan per
-- xid partition, walked in xid order, reading what it returns.
--
-- The second column is the expression (seq + 0), not seq: an index on (xid, seq) also serves every other
-- query that orders one bucket's events by (xid, seq), and on PostgreSQL 15 the planner chose it for the
-- relay's read (fetch_events) from the start of history, walking all buckets' events to keep one bucket's
-- (12x the rows it returned). Only a query that orders by (xid, seq + 0), bulk_read, can walk this one;
-- the others keep events_position. The commit probes of 0010 (outbox.watch_commits_v1: a range from an
-- xmax, one probe per open id) use its first column as before. One index entry per event as before.
-- Rebuilt on every partition while the table is locked (as 0014's indexes were): minutes for tens of
-- millions of events. No min-code-version: relays of version 15 and 16 run on it unchanged.
DROP INDEX outbox.events_xid;
CREATE INDEX events_xid ON outbox.events (xid, (seq + 0));
