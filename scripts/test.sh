#!/usr/bin/env bash
# Install outbox-relay with its test tools and run every check: the one command for a fresh machine.
#
#   scripts/test.sh              ruff, mypy (strict), the whole pytest suite (unit and integration in
#                                2 processes, then the acceptance tests in 2 processes); then the integration
#                                tests of the SQL again against PostgreSQL 15 at 127.0.0.1:5432 if it answers
#   scripts/test.sh -k publish   extra arguments: one pytest run with them instead of the first two
#
# Needs only python3 (3.11+) and PyPI: the tests start PostgreSQL 18 and a Kafka-protocol broker
# (Tansu) from wheels, or use Docker when an engine answers. Environment:
#   VENV                  virtualenv to create/use (default .venv)
#   PYTHON                interpreter that creates it (default python3)
#   OUTBOX_TEST_DSN       run the suite against this PostgreSQL instead of a private one
#   OUTBOX_TEST_KAFKA     ... and this Kafka (bootstrap servers)
#   OUTBOX_LOCAL_PG_DSN   the machine's PostgreSQL for the second run
#                         (default postgresql://postgres@127.0.0.1:5432/postgres)
# Every step runs even if an earlier one failed; the exit status is non-zero if any failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
LOCAL_PG_DSN=${OUTBOX_LOCAL_PG_DSN:-postgresql://postgres@127.0.0.1:5432/postgres}

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

step ruff "$VENV/bin/ruff" check .
step mypy "$VENV/bin/mypy"
# Unit and integration tests in 2 processes (each starts its own PostgreSQL and broker; most of the
# time is spent waiting on relays, not on the CPU), then the acceptance tests, also in 2 processes
# (they mostly wait on real relay processes: 9 minutes in one, 4.5 in two on 2 cores).
if [ $# -gt 0 ]; then
    step pytest "$VENV/bin/pytest" -p no:cacheprovider -q --durations=15 "$@"
else
    step pytest "$VENV/bin/pytest" -p no:cacheprovider -q --durations=10 -n 2 tests/unit tests/integration
    step pytest-acceptance "$VENV/bin/pytest" -p no:cacheprovider -q --durations=10 -n 2 tests/acceptance tests/faults
fi

# The machines' own PostgreSQL 15 (no uuidv7(), other planner defaults): the integration tests that
# run the relay's and the producers' SQL once more against it, in one process (they share that server:
# roles are server-wide). Left out: tests of Kafka, metrics, tracing, the CLI's connection handling and
# the ORM/testing-kit layers above publish, whose SQL the tests kept here already run, and the inbox's main
# tests (a Kafka consumer whose connection-cut test times its cut against the embedded server) and metrics;
# its attempts' SQL (test_inbox_attempts.py) runs here. The sink contract suite (every sink class, the
# webhook's too) and the stuck-handler tests exercise the sinks' Python over the relay's SQL, which the
# relay's own tests run here; they run in the first step only (this step is serial: the suite's longest).
if [ -z "${OUTBOX_TEST_DSN:-}" ]; then
    if "$VENV/bin/python" - "$LOCAL_PG_DSN" <<'PY' 2>/dev/null
import sys

import psycopg

psycopg.connect(sys.argv[1], connect_timeout=3).close()
PY
    then
        step pytest-local-pg env OUTBOX_TEST_DSN="$LOCAL_PG_DSN" \
            "$VENV/bin/pytest" -p no:cacheprovider -q --durations=10 -m "not slow" tests/integration \
            --ignore=tests/integration/test_cli_connection.py --ignore=tests/integration/test_dashboards.py \
            --ignore=tests/integration/test_kafka_broker_amnesia.py --ignore=tests/integration/test_kafka_config.py \
            --ignore=tests/integration/test_kafka_headers.py --ignore=tests/integration/test_kafka_idle.py \
            --ignore=tests/integration/test_metrics.py --ignore=tests/integration/test_relay_kafka.py \
            --ignore=tests/integration/test_tracing.py --ignore=tests/integration/test_testing_kit.py \
            --ignore=tests/integration/test_contrib_sqlalchemy.py --ignore=tests/integration/test_cli_projections.py \
            --ignore=tests/integration/test_inbox.py --ignore=tests/integration/test_inbox_metrics.py \
            --ignore=tests/integration/test_sink_contract.py --ignore=tests/integration/test_webhook.py \
            --ignore=tests/integration/test_stuck_sinks.py
    else
        echo
        echo "=== no PostgreSQL answers at $LOCAL_PG_DSN: skipping the second integration run"
    fi
fi

echo
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all checks passed"
