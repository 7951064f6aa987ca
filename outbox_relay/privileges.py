"""The documented roles' rights in schemas ``outbox`` and ``outbox_inbox``, declared once (docs/roles.md,
least-privilege roles; docs/inbox.md, roles).

``GRANTS`` is the one table: ``outbox-relay grants`` prints its SQL for schema outbox (docs/roles.md) or
outbox_inbox (docs/inbox.md; a consuming service's database holds it without outbox), and
tests/integration/test_privileges.py walks ``pg_class`` and ``pg_proc`` and checks every role's rights
against it, so a table or function that is not listed here (or is open to PUBLIC) fails that test.
Anything not granted here is the owner's (the migrator) alone.
"""

from __future__ import annotations

from dataclasses import dataclass

PRODUCER, RELAY, PROJECTOR = "outbox_producer", "outbox_relay", "outbox_projector"
CONSOLE = "outbox_console"
INBOX_CONSUMER = "outbox_inbox_consumer"
ROLES = (PRODUCER, RELAY, PROJECTOR, CONSOLE, INBOX_CONSUMER)
OUTBOX, INBOX = "outbox", "outbox_inbox"
SCHEMAS = (OUTBOX, INBOX)  # the product's schemas: nothing in them is open to PUBLIC
TABLE_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")


@dataclass(frozen=True)
class Grant:
    why: str  # the comment above the statement in the generated SQL
    privileges: tuple[str, ...]  # SELECT, INSERT, ... or EXECUTE (objects are then function signatures)
    objects: tuple[str, ...]  # names in ``schema``, without it
    roles: tuple[str, ...]
    columns: tuple[str, ...] = ()  # a column grant (one privilege)
    schema: str = OUTBOX

    @property
    def functions(self) -> bool:
        return self.privileges == ("EXECUTE",)


_RELAY_TABLES = ("sinks", "workers", "assignments", "cursors", "parked", "dead_letters", "rebuilds")

GRANTS: tuple[Grant, ...] = (
    Grant("Producers: append only, and only the columns a producer may choose (the trigger events_check "
          "refuses an xid or created_at of the producer's choosing in any case).",
          ("INSERT",), ("events",), (PRODUCER,),
          ("id", "topic", "partition_key", "type", "payload", "headers", "idempotency_key", "occurred_at",
           "schema_version")),
    Grant("Idempotency: `publish` returns the id of the event stored earlier under the same key and topic, and "
          "tells a retry from a reuse with other content by the fingerprint (a hash), not by the payload.",
          ("SELECT",), ("events",), (PRODUCER,), ("id", "topic", "idempotency_key", "idempotency_fingerprint")),
    Grant("", ("SELECT",), ("idempotency_keys",), (PRODUCER,)),
    Grant("The generated bucket column, and the fingerprint a producer compares (docs: idempotency keys).",
          ("EXECUTE",), ("bucket_v1(text)", "fingerprint_v1(text, text, jsonb)"), (PRODUCER,)),
    Grant("Relays: read events (retention drops whole partitions through functions that run as the schema's "
          "owner, docs/history.md). UPDATE on sinks: `sinks drop` leaves a tombstone.",
          ("SELECT",), ("events", "partitions", "retention_classes", "topic_retention"), (RELAY,)),
    Grant("", ("SELECT",), ("schema_migrations",), (RELAY, PROJECTOR)),
    Grant("", ("SELECT", "INSERT", "UPDATE", "DELETE"), (*_RELAY_TABLES, "paused_keys"), (RELAY,)),
    Grant("Housekeeping: only roles that may update this row take part (one relay per interval does the work); "
          "the pass stores the relay's --retention-seconds in it, which is all that retention goes by.",
          ("SELECT", "UPDATE"), ("housekeeping",), (RELAY,)),
    Grant("Retention moves the history watermark; every relay reads it when it registers a sink, and rebuilds "
          "read it to refuse a partial model.",
          ("SELECT", "UPDATE"), ("history",), (RELAY,)),
    Grant("", ("SELECT",), ("history",), (PROJECTOR,)),
    Grant("... per retention class and topics, and copies of parked and dead-lettered events whose partition "
          "retention dropped (a retry delivers the copy; written by functions that run as the schema's owner).",
          ("SELECT",), ("history_removed", "kept_events"), (RELAY, PROJECTOR)),
    Grant("Every relay (Kafka or projection) reads and waits for events with these.",
          ("EXECUTE",),
          ("bucket_v1(text)", "delivered_v1(xid8, bigint, pg_snapshot, pg_snapshot, xid8, bigint)",
           "bucket_has_work_v2(text, integer, pg_snapshot, pg_snapshot, xid8, bigint)",
           "bucket_has_work_v3(text, integer, pg_snapshot, pg_snapshot, xid8, bigint)",
           "watch_commits_v1(pg_snapshot, integer, double precision)",
           "history_covers_v1(text[], text[], text[])", "history_stored_from_v1(text[])"),
          (RELAY, PROJECTOR)),
    Grant("Only relays make, roll and retire partitions (ACCESS EXCLUSIVE on outbox.events) and release kept "
          "copies; retention keeps what outbox.housekeeping.default_keep and the classes say, whatever the "
          "caller passes (retire_partition_v1, partition_hold_v1: relays of schema version 18 may only keep longer).",
          ("EXECUTE",),
          ("add_partition_v1(bigint, double precision)", "roll_partition_v1(bigint, double precision)",
           "retire_partition_v1(interval)", "retire_partition_v2()", "release_kept_events_v1()",
           "partition_hold_v1(text, interval)", "partition_oldest_v1(text)", "class_keep_v1(text, interval)"),
          (RELAY,)),
    Grant("Projectors: read events, register and keep the state of projection sinks only (row security below); "
          "no DELETE on events, no housekeeping (SELECT only: a relay warns when housekeeping is overdue). "
          "Paused keys (`outbox-relay keys pause`) are read by every relay; operators change them as outbox_relay.",
          ("SELECT",), ("events", "housekeeping", "paused_keys"), (PROJECTOR,)),
    Grant("", ("SELECT", "INSERT", "UPDATE", "DELETE"), _RELAY_TABLES, (PROJECTOR,)),
    Grant("A projection batch's guard (a constraint trigger on the connection's own temporary table) and its end.",
          ("EXECUTE",), ("projection_batch_guard_v1()", "projection_batch_end_v1(text)"), (PROJECTOR,)),
    # The operator console (outbox_relay/console, sql/queries/console.sql): it reads what `status`, `keys show`
    # and `dead-letters list` read, and acts only as `keys retry|skip|pause|resume` and `dead-letters
    # retry|discard` do. No rights on workers, assignments, housekeeping or the partitions' functions that change
    # anything; no DELETE or UPDATE of events.
    Grant("The console (`outbox-relay console`): reads events (the ledger shows payloads and headers), sinks, "
          "relays, cursors, the park, dead letters, pauses, rebuilds and history; writes nothing there but what an "
          "operator's action changes.",
          ("SELECT",), ("events", "sinks", "workers", "cursors", "parked", "dead_letters", "paused_keys", "rebuilds",
                        "partitions", "retention_classes", "topic_retention", "history", "history_removed",
                        "kept_events", "housekeeping", "schema_migrations", "console_audit", "console_samples"),
          (CONSOLE,)),
    Grant("Its actions: a retry makes a parked head due or moves dead letters back to the park, a skip moves the "
          "head to dead letters, a discard deletes dead letters, a pause or resume adds or removes a paused key.",
          ("INSERT", "UPDATE", "DELETE"), ("parked",), (CONSOLE,)),
    Grant("", ("INSERT", "DELETE"), ("dead_letters", "paused_keys"), (CONSOLE,)),
    Grant("A skip of an event dead-lettered before (and retried since) updates its dead letter.",
          ("UPDATE",), ("dead_letters",), (CONSOLE,), ("attempts", "last_error", "dead_at")),
    Grant("A skip fences the key's bucket first (an attempt in flight then lands nothing).",
          ("UPDATE",), ("cursors",), (CONSOLE,), ("fence", "fenced_by")),
    Grant("Actions lock the sink's row against a drop (SELECT ... FOR SHARE needs UPDATE on one column: "
          "created_at, which nothing but listings reads).",
          ("UPDATE",), ("sinks",), (CONSOLE,), ("created_at",)),
    Grant("Every action's audit record, and the per-minute samples the overview's charts draw (a day is kept).",
          ("INSERT",), ("console_audit", "console_samples"), (CONSOLE,)),
    Grant("", ("DELETE",), ("console_samples",), (CONSOLE,)),
    Grant("The ledger asks whether a cursor delivered an event; the history page what holds each partition.",
          ("EXECUTE",),
          ("bucket_v1(text)", "delivered_v1(xid8, bigint, pg_snapshot, pg_snapshot, xid8, bigint)",
           "history_covers_v1(text[], text[], text[])", "history_stored_from_v1(text[])",
           "partition_oldest_v1(text)", "partition_hold_v1(text, interval)", "class_keep_v1(text, interval)"),
          (CONSOLE,)),
    # The inbox (sql/queries/inbox.sql): `outbox-relay inbox run`, and the operator commands `inbox status` and
    # `inbox dead-letters`, which need nothing the consumer does not. No DDL: `inbox migrate` is the owner's.
    Grant("Inbox consumers: `inbox run` and `inbox status` check the tables' version first.",
          ("SELECT",), ("schema_migrations",), (INBOX_CONSUMER,), schema=INBOX),
    Grant("Processes register and heartbeat, leave when they stop, and delete registrations of crashed ones.",
          ("SELECT", "INSERT", "UPDATE", "DELETE"), ("members",), (INBOX_CONSUMER,), schema=INBOX),
    Grant("Partitions seen first are added; leases are claimed, renewed and released with a fence, and the position "
          "moves in each message's transaction. Never deleted: a position lost would apply its partition again.",
          ("SELECT", "INSERT", "UPDATE"), ("positions",), (INBOX_CONSUMER,), schema=INBOX),
    Grant("Dedupe records are inserted in the handler's transaction, never changed; retention deletes the expired.",
          ("SELECT", "INSERT", "DELETE"), ("messages",), (INBOX_CONSUMER,), schema=INBOX),
    Grant("Dead letters are written by the consumer, taken for a retry and deleted when it applied them; operators "
          "list them, ask for a retry (UPDATE) and drop them.",
          ("SELECT", "INSERT", "UPDATE", "DELETE"), ("dead_letters",), (INBOX_CONSUMER,), schema=INBOX),
)

# Functions no role but the owner may call: triggers (PostgreSQL does not check EXECUTE when a trigger
# fires, only when one is created), and helpers that the owner's functions call.
OWNER_ONLY_FUNCTIONS = ("check_event_v4()", "events_no_delete_v1()", "header_name_key_v1(text)",
                        "range_open_v1(xid8, xid8)")

_ROW_SECURITY_TABLES = ("sinks", "assignments", "cursors", "parked", "dead_letters")

_CONSOLE_ROW_TABLES = ("sinks", "cursors", "parked", "dead_letters")

ROW_SECURITY = "\n".join((
    "-- Row security: a projector sees and changes projection sinks' rows only. The table owner (the",
    "-- migrator) is not subject to it; relays and the console see every sink's (within their grants).",
    *(f"ALTER TABLE outbox.{t} ENABLE ROW LEVEL SECURITY;" for t in _ROW_SECURITY_TABLES),
    *(f"DROP POLICY IF EXISTS relay_all ON outbox.{t};" for t in _ROW_SECURITY_TABLES),
    *(f"CREATE POLICY relay_all ON outbox.{t} TO {RELAY} USING (true);" for t in _ROW_SECURITY_TABLES),
    *(f"DROP POLICY IF EXISTS console_all ON outbox.{t};" for t in _CONSOLE_ROW_TABLES),
    *(f"CREATE POLICY console_all ON outbox.{t} TO {CONSOLE} USING (true);" for t in _CONSOLE_ROW_TABLES),
    *(f"DROP POLICY IF EXISTS projections_only ON outbox.{t};" for t in _ROW_SECURITY_TABLES),
    f"CREATE POLICY projections_only ON outbox.sinks TO {PROJECTOR} USING (kind = 'projection');",
    *(f"CREATE POLICY projections_only ON outbox.{t} TO {PROJECTOR}\n"
      "    USING (sink IN (SELECT name FROM outbox.sinks WHERE kind = 'projection'));"
      for t in _ROW_SECURITY_TABLES[1:]),
))


def close_to_public(schema: str) -> str:
    """What ``migrate`` (and ``inbox migrate``) runs after applying migrations: nothing in ``schema`` open
    to PUBLIC, so that a function a later migration adds starts closed (PostgreSQL grants EXECUTE on new
    functions to PUBLIC, and ``ALTER DEFAULT PRIVILEGES ... IN SCHEMA`` can not revoke that: a per-schema
    default only adds to the global one)."""
    assert schema in SCHEMAS  # a fixed name, never input
    kinds = ("SCHEMA", "ALL TABLES IN SCHEMA", "ALL SEQUENCES IN SCHEMA", "ALL FUNCTIONS IN SCHEMA")
    return "\n".join(f"REVOKE ALL ON {kind} {schema} FROM PUBLIC;" for kind in kinds)


def _comment(text: str) -> list[str]:
    lines, line = [], "--"
    for word in text.split():
        if len(line) + 1 + len(word) > 105:
            lines.append(line)
            line = "--"
        line += " " + word
    return [*lines, line] if text else []


def roles_of(schema: str) -> tuple[str, ...]:
    """The documented roles granted anything in ``schema`` (a block names only these: a consuming service's
    database has the inbox's role and none of the relay's)."""
    return tuple(r for r in ROLES if any(schema == g.schema and r in g.roles for g in GRANTS))


def schemas_of(role: str) -> tuple[str, ...]:
    """The schemas ``role`` has USAGE on."""
    return tuple(s for s in SCHEMAS if role in roles_of(s))


def grants_sql(schema: str = OUTBOX) -> str:
    """The grants block of ``schema`` (docs/roles.md: outbox, docs/inbox.md: outbox_inbox): run as the
    migrator after every migration, in one transaction. It takes everything back from PUBLIC and the schema's
    documented roles first, so that a rerun leaves exactly ``GRANTS``."""
    assert schema in SCHEMAS
    roles = ", ".join(roles_of(schema))
    out = [
        "BEGIN;",
        "-- Start from nothing (PUBLIC included), so that a rerun after an upgrade leaves exactly these grants.",
        *(f"REVOKE ALL ON {kind} {schema} FROM PUBLIC, {roles};"
          for kind in ("SCHEMA", "ALL TABLES IN SCHEMA", "ALL SEQUENCES IN SCHEMA", "ALL FUNCTIONS IN SCHEMA")),
        f"GRANT USAGE ON SCHEMA {schema} TO {roles};",
    ]
    for g in GRANTS:
        if g.schema == schema:
            out += ["", *_comment(g.why)] if g.why else []
            out.append(_statement(g, ", ".join(g.roles)))
    return "\n".join([*out, "", *([ROW_SECURITY] if schema == OUTBOX else []), "COMMIT;"]) + "\n"


def grant_statements(role: str, grantee: str) -> list[str]:
    """The GRANTs of ``role`` (one of ROLES) given to ``grantee`` instead (a quoted identifier): for a
    login that should hold exactly one kind's rights without being a member of it (tests)."""
    return [*(f"GRANT USAGE ON SCHEMA {s} TO {grantee};" for s in schemas_of(role)),
            *(_statement(g, grantee) for g in GRANTS if role in g.roles)]


def _statement(g: Grant, grantees: str) -> str:
    kind = "FUNCTION " if g.functions else ""
    objects = kind + ", ".join(f"{g.schema}.{o}" for o in g.objects)
    columns = f" ({', '.join(g.columns)})" if g.columns else ""
    privileges = ", ".join(g.privileges)
    line = f"GRANT {privileges}{columns} ON {objects} TO {grantees};"
    if len(line) > 110:  # one object a line
        objects = kind + f",\n       {' ' * len(kind)}".join(f"{g.schema}.{o}" for o in g.objects)
        line = f"GRANT {privileges}{columns}\n    ON {objects}\n    TO {grantees};"
    return line


def _of(role: str, schema: str) -> list[Grant]:
    return [g for g in GRANTS if role in g.roles and g.schema == schema]


def expected_table_rights(role: str, schema: str = OUTBOX) -> dict[str, set[str]]:
    """Table (name in ``schema``) -> the table-level privileges ``role`` holds by ``GRANTS``."""
    rights: dict[str, set[str]] = {}
    for g in _of(role, schema):
        if not g.functions and not g.columns:
            for o in g.objects:
                rights.setdefault(o, set()).update(g.privileges)
    return rights


def expected_column_rights(role: str, schema: str = OUTBOX) -> dict[tuple[str, str], set[str]]:
    """(table, privilege) -> the columns ``role`` holds it on by a column grant."""
    rights: dict[tuple[str, str], set[str]] = {}
    for g in _of(role, schema):
        if g.columns:
            for o in g.objects:
                for p in g.privileges:
                    rights.setdefault((o, p), set()).update(g.columns)
    return rights


def expected_functions(role: str, schema: str = OUTBOX) -> set[str]:
    """Signatures (``name(types)`` in ``schema``) that ``role`` may EXECUTE."""
    return {o for g in _of(role, schema) if g.functions for o in g.objects}


def declared_functions(schema: str = OUTBOX) -> set[str]:
    """Every function of ``schema`` this module knows of (granted to a role, or the owner's alone)."""
    owners = set(OWNER_ONLY_FUNCTIONS) if schema == OUTBOX else set()
    return {o for g in GRANTS if g.functions and g.schema == schema for o in g.objects} | owners
