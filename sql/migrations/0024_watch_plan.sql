-- 0024_watch_plan: the commit watcher's looks read the events_xid index whatever the statistics said
-- when its session planned them.
--
-- PL/pgSQL plans a look once per session (custom plans, then a cached generic one) and keeps the plan
-- until the partition is next analysed. A relay starts its watch on a new partition that autovacuum
-- has just analysed empty: the planner, believing it, scans the leaf sequentially, and keeps doing so
-- at every look while the partition grows (a look a millisecond: the watcher's backend at half a core
-- at 5,000 events/s with 75,000 rows; bench/results/2026-12-04-watcher-plan.md). With sequential scans
-- off for the function, its plans take the index (a bitmap or index scan) on an empty leaf too, where
-- that costs as little. Arguments and results are unchanged: relays of the previous version use it as before.

ALTER FUNCTION outbox.watch_commits_v1(pg_snapshot, integer, double precision) SET enable_seqscan = off;
