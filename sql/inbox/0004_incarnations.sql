-- 0004_incarnations: a lease belongs to one run of a process, not to its member id.
--
-- A consumer restarted with the same --member-id (a StatefulSet pod, a systemd unit, a restart after
-- the OOM killer) renewed the leases its killed predecessor held, by owner = member id, without
-- consuming them: nobody could claim them and the partitions were never applied again. Each run of
-- a process now has an incarnation of its own (random, at start): it renews and gives up only the
-- leases it claimed; its predecessor's run out after their lease and are claimed as lapsed (applied
-- carefully, a crash during the next message counts). `inbox status` tells the two apart.

ALTER TABLE outbox_inbox.members
    ADD COLUMN incarnation text;                        -- the run of the process heard from last

ALTER TABLE outbox_inbox.positions
    ADD COLUMN owner_incarnation text;                  -- the run of `owner` that claimed the lease
