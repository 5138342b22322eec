#!/usr/bin/env bash
# Create .venv and install anatomist with its test tools, without CUDA wheels on a machine
# that has no NVIDIA GPU. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" 2>/dev/null; then
  "$VPY" -m pip install -q --upgrade pip
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch>=2.9"
  else
    # A CPU build: the pinned file this kind of machine carries, else PyTorch's CPU index.
    "$VPY" -m pip install -q torch==2.13.0 2>/dev/null \
      || "$VPY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$VPY" -m pip install -q -e ".[dev]" 2>&1 | grep -v -e "^WARNING: Location" -e "^$" || true
# DeepSpeed (an optional extra; its config and ZeRO tests need it) imports torch in its setup.py,
# so it goes in after torch, without build isolation. If that fails, its tests are skipped.
if ! "$VPY" -c "import deepspeed" >/dev/null 2>&1; then
  "$VPY" -m pip install -q --no-build-isolation "deepspeed>=0.14" >/dev/null 2>&1 \
    || echo "deepspeed could not be installed: its tests will be skipped"
fi
"$VPY" -c "import anatomist, torch, transformers; print(f'anatomist ready: torch {torch.__version__}, transformers {transformers.__version__}')"
