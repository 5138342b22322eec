"""Predict a GPU's measured bench rows again with this tree, beside what the GPU measured.

    PYTHONPATH=src python benchmarks/gpu/repredict.py benchmarks/gpu/H200

A row's prediction in its `bench.jsonl` is the one the tree of its day made; this one is today's, so a change of
the model can be checked against every GPU run kept here without a GPU. Measured, from the run's own counters:

- peak allocated: the allocator's peak in the step the callback attributed;
- peak reserved: the allocator's peak reserve over the whole run (`torch.cuda.max_memory_reserved`);
- device total: that reserve plus what lay outside the allocator once the run had ended (NVML's used memory less
  the reserve then): the CUDA context after the step's kernels had loaded, which is what nvidia-smi adds;
- step time: the callback's median optimizer step.

Prints a markdown table (signed error, predicted / measured - 1) and whether each measured step time fell in the
predicted "likely" range.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from anatomist.bench.calibrate import row_workload
from anatomist.estimate.memory import estimate_memory
from anatomist.estimate.time.device import estimate_time
from anatomist.hardware import match_catalog
from anatomist.recipe import Recipe

MIB = 2**20


def measured(row: dict[str, Any]) -> dict[str, float]:
    m = row["measured"]
    allocator = m["allocator"]
    outside = m["device_memory"]["used_bytes"] - allocator["reserved_bytes"]
    return {"peak_allocated": m["memory"]["peak_allocated"], "peak_reserved": allocator["peak_reserved_bytes"],
            "device_total": allocator["peak_reserved_bytes"] + outside, "step_s": m["time"]["median_step_s"]}


def cuda_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a bench.jsonl that ran to the end on a CUDA GPU."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("status") == "ok" and (r.get("device") or {}).get("kind") == "cuda"]


def predicted(row: dict[str, Any], folder: Path, *, time: bool = True) -> dict[str, Any]:
    """This tree's memory of `row` and, with `time`, its step time and likely range."""
    device = row["device"]
    gpu = match_catalog(device["name"], int(device["memory_bytes"]))
    if gpu is None:
        sys.exit(f"repredict: {device['name']!r} is not in the GPU catalog")
    workload = row_workload(row["workload"], folder)
    recipe = Recipe.from_dict(row["recipe"]).resolved(workload)
    memory = estimate_memory(workload, recipe, gpu).anatomy
    out = {"gpu": gpu.name, "dtype": recipe.dtype, "peak_allocated": memory.peak_allocated,
           "peak_reserved": memory.peak_reserved, "device_total": memory.device_total}
    if not time:
        return out
    step = estimate_time(workload, recipe, gpu)
    return {**out, "step_s": step.step_s, "interval": (step.interval.low, step.interval.high) if step.interval else None}


def error(p: float, m: float) -> str:
    return f"{(p / m - 1) * 100:+.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a device's folder of benchmarks/gpu (its bench.jsonl)")
    args = parser.parse_args()
    rows = cuda_rows(args.folder / "bench.jsonl")
    print("| row | peak allocated MiB (pred / meas / err) | peak reserved MiB | device total MiB | step ms | "
          "in the likely range |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="anatomist-repredict-") as tmp:
        for i, row in enumerate(rows):
            folder = Path(tmp, str(i))
            folder.mkdir()
            p, m = predicted(row, folder), measured(row)
            cells = [f"{p[k] / MIB:,.0f} / {m[k] / MIB:,.0f} / {error(p[k], m[k])}"
                     for k in ("peak_allocated", "peak_reserved", "device_total")]
            step = f"{p['step_s'] * 1e3:.1f} / {m['step_s'] * 1e3:.1f} / {error(p['step_s'], m['step_s'])}"
            low, high = p["interval"] or (None, None)
            inside = "-" if low is None else (f"{'yes' if low <= m['step_s'] <= high else 'no'} "
                                               f"({low * 1e3:.0f}-{high * 1e3:.0f} ms)")
            print(f"| {row['suite']}/{row['name']} | {' | '.join(cells)} | {step} | {inside} |")


if __name__ == "__main__":
    main()
