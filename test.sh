#!/usr/bin/env bash
# Set everything up (test tools, Chromium and .venv-vllm for the vLLM tests included), then run the whole test
# suite (what CI runs).
#   ./test.sh [pytest options]           everything (`./test.sh -m 'not vllm'` leaves the vLLM tests out)
#   ./test.sh --fast [pytest options]    the quick tier: no Chromium, no default model, no servers, no package build,
#                                        no vLLM
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "--fast" ]; then
  shift
  scripts/setup.sh --tools
  export REST_LAB_FAST_TESTS=1
  exec .venv/bin/python -m pytest -m "not (model or browser or server or package or slow or vllm)" "$@"
fi
scripts/setup.sh --dev --vllm
exec .venv/bin/python -m pytest "$@"
