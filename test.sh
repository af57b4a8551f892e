#!/usr/bin/env bash
# Set everything up (test tools, Chromium and .venv-vllm for the vLLM tests included), then run the whole test
# suite (`./test.sh -m 'not vllm'` leaves the vLLM tests out).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh --dev --vllm
exec .venv/bin/python -m pytest "$@"
