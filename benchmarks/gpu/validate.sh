#!/usr/bin/env bash
# Every GPU check of anatomist in one resumable command. See benchmarks/gpu/README.md.
#
#   benchmarks/gpu/validate.sh [--dry-run | --plan] [--part a,c] [--redo d] [--out DIR] [--budget-s 540,180]
#
# On a GPU machine: installs the wheels carried in .whl/ if any (into a folder of their own, no
# network), then runs benchmarks/gpu/validate.py on the working tree's anatomist (through PYTHONPATH:
# nothing is installed, and the machine's torch, transformers, accelerate and peft are used as they are).
# With --dry-run or --plan nothing is installed. PYTHON picks the interpreter (default python3). When
# $OUT is set (a lent GPU), the result files are also copied to $OUT/<device>/ after every unit, so
# that they come back even from a command stopped at its limit.
set -euo pipefail

# --budget-s counts from here: the wheels' install is part of the call's time
VALIDATE_STARTED_AT=$(date +%s.%N)
export VALIDATE_STARTED_AT

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${PYTHON:-python3}
on_gpu=1
for arg in "$@"; do
  [[ $arg == --dry-run || $arg == --plan ]] && on_gpu=0
done

export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1

wheels=()
if [[ -d $repo/.whl ]]; then
  shopt -s nullglob
  wheels=("$repo"/.whl/*.whl)
  shopt -u nullglob
fi

if [[ $on_gpu == 0 ]]; then
  echo "validate.sh: installing nothing here (on a GPU: ${#wheels[@]} carried wheel(s))" >&2
else
  if (( ${#wheels[@]} )); then
    # Into a folder of their own, first on the path: the machine's packages stay as they are.
    site=${TMPDIR:-/tmp}/anatomist-wheels
    echo "validate.sh: installing ${#wheels[@]} carried wheel(s) into $site" >&2
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
    export PYTHONPATH="$repo/src:$site:${PYTHONPATH#"$repo/src:"}"
  fi
  missing=$("$py" -c 'import importlib.util as u, sys; print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' \
    datasets liger_kernel bitsandbytes)
  [[ -z $missing ]] \
    || echo "validate.sh: note: not here: $missing: the bench rows that need them are recorded as failed (datasets) or skipped; carry them (README.md)" >&2
fi

copy=()
if [[ $on_gpu == 1 && -n ${OUT:-} ]]; then
  copy=(--copy-to "$OUT")
fi
exec "$py" "$here/validate.py" --python "$py" "${copy[@]}" "$@"
