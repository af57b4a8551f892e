#!/usr/bin/env bash
# Set everything up (test tools and Chromium included), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh --dev
exec .venv/bin/python -m pytest "$@"
