#!/usr/bin/env bash
# `make test-floor`: build a venv at pyproject.toml's dependency floors (scripts/floors.py: every
# `name>=X` installed as `name==X`) and run the tests that exercise what those libraries do for
# us: building and tracing models (transformers), LoRA/QLoRA (peft), the Trainer and Accelerate
# loops and `accelerate launch` (accelerate, datasets), the report's charts (matplotlib).
# torch's floor is tested only on a machine with an NVIDIA GPU; elsewhere the venv gets the torch
# setup.sh installs (see floors.py). Needs PyPI; about 4 minutes on a 2-core machine. FLOOR_VENV=... to
# build elsewhere (default .venv-floor); the venv is rebuilt from scratch on every run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FLOOR_VENV:-.venv-floor}
rm -rf "$VENV"
"$PY" -m venv "$VENV"
VPY=$VENV/bin/python
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TORCH=--with-torch  # PyPI's torch is a CUDA build: torch's floor is tested too
else
  TORCH=""  # the same torch as scripts/setup.sh: the CPU file this kind of machine carries
  "$VPY" -m pip install -q torch==2.13.0 2>/dev/null \
    || "$VPY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
{ "$PY" scripts/floors.py $TORCH; "$PY" scripts/floors.py dev | grep '^pytest=='; } > "$VENV/floors.txt"
echo "floors: $(tr '\n' ' ' < "$VENV/floors.txt")"
"$VPY" -m pip install -q -r "$VENV/floors.txt"
# pip would have failed on a pin it could not meet; check anyway that nothing moved them.
"$VPY" - "$VENV/floors.txt" <<'EOF'
import sys
from importlib.metadata import version

from packaging.version import Version  # a dependency of transformers

pins = [line.split("==") for line in open(sys.argv[1]).read().split()]
wrong = [f"{name}=={floor} (installed {version(name)})" for name, floor in pins if Version(version(name)) != Version(floor)]
if wrong:
    sys.exit("not at the floor: " + ", ".join(wrong))
EOF
# The bench workers are subprocesses: they find the package through PYTHONPATH, as the tests do.
export PYTHONPATH="$PWD/src"
export ANATOMIST_CACHE_DIR="$VENV/cache"
"$VPY" -m pytest -q -p no:cacheprovider \
  tests/test_flops.py tests/test_peft.py tests/test_estimate_accuracy.py tests/test_measure.py \
  tests/test_bench_cli.py tests/test_bench_distributed.py tests/test_plan_emit.py tests/test_units.py \
  tests/test_workload_errors.py tests/test_time_estimate.py tests/test_cli_errors.py \
  tests/test_autocast_policy.py tests/test_extrapolation.py tests/report/test_charts.py tests/report/test_report_html.py
