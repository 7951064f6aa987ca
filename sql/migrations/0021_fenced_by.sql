-- 0021_fenced_by: a relay tells an operator's re-fence from a takeover.
--
-- `keys skip` and a rebuild's switch-over bump a bucket's fence while its owner keeps the lease, so
-- that an attempt in flight lands nothing. The owner then logged "fenced out ... lost the lease" as a
-- WARNING, the same words as another relay taking its buckets: routine actions read like an incident.
-- The action now names itself in the row; the owner logs it at INFO and the next acquisition clears it.
--
-- No min-code-version: older relays neither read nor clear the column (they log as before).

ALTER TABLE outbox.cursors ADD COLUMN fenced_by text;
COMMENT ON COLUMN outbox.cursors.fenced_by IS
    'the operator action that last bumped fence while the owner kept its lease (keys skip, a rebuild''s '
    'switch-over); cleared when a relay acquires the lease';
