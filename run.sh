#!/usr/bin/env bash
# Set everything up, then start REST Lab on the offline default model and datastore.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
exec .venv/bin/python app.py "$@"
