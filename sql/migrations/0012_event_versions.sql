-- 0012_event_versions: events carry the version of their payload's schema.
--
-- Producers say which shape a payload has (`publish(..., version=2)`, or the column from SQL); 1 is
-- the default, so existing events and producers that never version stay at 1. Projections, rebuilds
-- and replays turn older payloads into the current shape with upcasters registered per (type,
-- version) (outbox_relay/upcast.py), so a read model can be rebuilt across a change of shape.
--
-- A constant default adds the column without rewriting the table (the CHECK reads it once).
ALTER TABLE outbox.events ADD COLUMN schema_version integer NOT NULL DEFAULT 1,
    ADD CONSTRAINT events_schema_version_valid CHECK (schema_version BETWEEN 1 AND 32767);

-- Producers granted INSERT on a list of columns (docs/roles.md) could no
-- longer publish: publish names the new column. Whoever may insert a payload may insert its version.
DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT p.grantee FROM information_schema.column_privileges p
        WHERE p.table_schema = 'outbox' AND p.table_name = 'events' AND p.column_name = 'payload'
          AND p.privilege_type = 'INSERT' AND p.grantee <> current_user
    LOOP
        IF grantee = 'PUBLIC' THEN
            GRANT INSERT (schema_version) ON outbox.events TO PUBLIC;
        ELSE
            EXECUTE format('GRANT INSERT (schema_version) ON outbox.events TO %I', grantee);
        END IF;
    END LOOP;
END
$$;
