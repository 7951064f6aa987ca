-- 0013_sink_kinds: sinks of any kind, not only 'kafka' and 'projection'.
--
-- A user's own sink (outbox_relay.sinks.EventSink, `outbox-relay run --sink MODULE:ATTR`) registers
-- under its own short kind ("webhook", "sqs", ...). Relays of older versions register only the two
-- kinds they know, which the new rule still accepts, so old and new relays overlap during a rollout
-- (no min-code-version).
ALTER TABLE outbox.sinks DROP CONSTRAINT sinks_kind_valid,
    ADD CONSTRAINT sinks_kind_valid CHECK (kind ~ '^[a-z][a-z0-9_]{0,31}$');
