#!/usr/bin/env bash
# Every GPU check of anatomist in one resumable command. See benchmarks/gpu/README.md.
#
#   benchmarks/gpu/validate.sh [--dry-run] [--part a,c] [--redo d] [--out DIR] [--budget-s 540]
#
# On a GPU machine: installs anatomist from this working tree (pip -e, no dependencies, no
# network) and the wheels carried in .whl/ if any, then runs benchmarks/gpu/validate.py. With
# --dry-run nothing is installed: the same driver runs on the CPU with tiny models.
# PYTHON picks the interpreter (default python3). When $OUT is set (a lent GPU), the result
# files are also copied to $OUT/<device>/ so that they come back.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${PYTHON:-python3}
dry_run=0
for arg in "$@"; do
  [[ $arg == --dry-run ]] && dry_run=1
done

# The working tree's code is what runs, installed or not (an install can fail offline).
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1

wheels=()
if [[ -d $repo/.whl ]]; then
  shopt -s nullglob
  wheels=("$repo"/.whl/*.whl)
  shopt -u nullglob
fi

if [[ $dry_run == 1 ]]; then
  echo "validate.sh: dry run: installing nothing (would install $repo with pip -e and ${#wheels[@]} carried wheel(s))" >&2
else
  if (( ${#wheels[@]} )); then
    # Into a folder of their own, first on the path: the machine's packages stay as they are.
    site=${TMPDIR:-/tmp}/anatomist-wheels
    echo "validate.sh: installing ${#wheels[@]} carried wheel(s) into $site" >&2
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
    export PYTHONPATH="$repo/src:$site:${PYTHONPATH#"$repo/src:"}"
  fi
  echo "validate.sh: installing anatomist from $repo (editable, no dependencies)" >&2
  pip_log=${TMPDIR:-/tmp}/anatomist-pip-install.log
  if ! "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e "$repo" >"$pip_log" 2>&1; then
    # e.g. a setuptools older than pyproject.toml's build requirement, and no network to get one
    echo "validate.sh: pip install failed ($pip_log); running from $repo/src through PYTHONPATH instead" >&2
  fi
  "$py" -c "import datasets" 2>/dev/null \
    || echo "validate.sh: warning: no 'datasets' here: part c's bench rows will fail; carry it (README.md)" >&2
fi

copy=()
if [[ $dry_run == 0 && -n ${OUT:-} ]]; then
  copy=(--copy-to "$OUT")
fi
exec "$py" "$here/validate.py" --python "$py" "${copy[@]}" "$@"
