#!/usr/bin/env bash
# Download, HERE (a machine with PyPI), the wheels a lent GPU machine lacks, into .whl/ at the
# repo root (git ignores it), for Python 3.12 on x86-64 Linux: the GPU machine's interpreter.
# validate.sh installs whatever .whl/ holds; name .whl in the run's `carry`.
#
#   benchmarks/gpu/fetch_wheels.sh                 # the defaults below
#   benchmarks/gpu/fetch_wheels.sh NAME==VERSION…  # others (no dependencies are fetched: name each)
#
# Defaults: datasets and the two dependencies the GPU image lacks (the bench worker builds a
# datasets.Dataset, as the seeds do), bitsandbytes for the 8-bit Adam and QLoRA rows (42 MB) and
# liger-kernel 0.8.5 (the version anatomist's Liger model follows; pure Python, its Triton is the
# image's) for the Liger rows: 43 MB in all, and the working tree and carried paths together must
# stay under 64 MiB. datasets 5.2 needs
# pyarrow >= 24: if the GPU machine's is older, add pyarrow (about 40 MB) and leave out bitsandbytes.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=${PYTHON:-python3}
if (( $# )); then
  wanted=("$@")
else
  wanted=(datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 bitsandbytes==0.50.2 liger-kernel==0.8.5)
fi
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
mkdir -p "$repo/.whl"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$repo/.whl" "${wanted[@]}"
du -ch "$repo"/.whl/*.whl
