"""Set this tree's prediction of each phase beside what part a's host-overlap unit measured (overlap.py).

    PYTHONPATH=src python benchmarks/gpu/overlap_report.py benchmarks/gpu/H200

For each row of the folder's results.jsonl (unit host-overlap): the kernels of forward and of backward, the GPU's
busy seconds and the host's issue seconds of each, measured and predicted. Predicted as the time model prices a
phase, with its own code (estimate/time/device.py, `phase_work`): each op's GPU seconds at the GPU's calibration,
and its kernels weighted by phase (`roofline.host_kernels`, checkpointing's recomputed ones at
RECOMPUTE_HOST_WEIGHT) times `host_op_s`; the phase is the slower of the two. Measured: the wall time against max(GPU, host) says whether they
overlapped, and the profiled span less the busy time how long the GPU waited on the host.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from anatomist.calibration.lookup import calibration_for
from anatomist.estimate.time.device import phase_work
from anatomist.estimate.time.ops import step_ops
from anatomist.hardware import get_gpu, match_catalog
from anatomist.recipe import Recipe
from anatomist.workload_loader import load_workload

PHASES = ("forward", "backward")


def predicted(details: dict[str, Any], gpu: Any) -> dict[str, float]:
    """Kernels, GPU seconds and host seconds of forward and backward for the row's setting (no optimizer)."""
    workload = load_workload(details["model"], seq_len=details["seq_len"], task="causal-lm")
    recipe = Recipe(per_device_train_batch_size=details["batch"], dtype=details["dtype"], bf16=details.get("bf16", False),
                    gradient_checkpointing=details["checkpointing"], attn_implementation=details["attn"],
                    optim="sgd", max_grad_norm=0.0).resolved(workload)
    cal = calibration_for(gpu)
    work = phase_work(step_ops(workload, recipe, gpu.compute_capability), workload, recipe, gpu, cal)
    out = {}
    for i, phase in enumerate(work.gpu_s):
        name = str(phase)
        if name in PHASES:
            out[f"kernels_{name}"], out[f"gpu_{name}_s"] = work.kernels[phase], work.gpu_s[phase]
            out[f"host_{name}_s"] = work.host_kernels[i] * cal.factors.host_op_s
    return out


def rows_of(folder: Path) -> list[dict[str, Any]]:
    lines = (folder / "results.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return [r for r in rows if r.get("unit") == "host-overlap" and r.get("status") == "ok" and "record" not in r]


def device_of(folder: Path) -> Any:
    """The catalog GPU of the folder's last env record (a GPU run), else the H100 (a dry run's CPU rows)."""
    lines = (folder / "results.jsonl").read_text().splitlines()
    envs = [e for e in (json.loads(line) for line in lines if line.strip()) if e.get("record") == "env"]
    device = (envs[-1].get("device") or {}) if envs else {}
    return match_catalog(device.get("name", ""), int(device.get("memory_bytes") or 0)) or get_gpu("H100-SXM")


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a device's folder of benchmarks/gpu (its results.jsonl)")
    args = parser.parse_args(argv)
    if not (args.folder / "results.jsonl").is_file():
        print(f"overlap_report: no results.jsonl in {args.folder} (a folder validate.sh wrote)", file=sys.stderr)
        return 2
    rows = rows_of(args.folder)
    if not rows:
        print(f"overlap_report: no host-overlap rows in {args.folder / 'results.jsonl'}", file=sys.stderr)
        return 2
    gpu = device_of(args.folder)
    print(f"host-overlap rows of {args.folder}, predicted for {gpu.name} (ms; kernels)")
    print("| setting | phase | kernels meas / pred | GPU busy meas / pred | host issue meas / pred | wall (both phases) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        m, p = row["details"]["measured"], predicted(row["details"], gpu)
        for phase in PHASES:
            wall = ms(m["wall_s"]) if phase == "forward" else ""
            kernels = m.get(f"kernels_{phase}")
            print(f"| {row['name']} | {phase} | {'-' if kernels is None else kernels} / {p[f'kernels_{phase}']:.0f} | "
                  f"{ms(m.get(f'gpu_{phase}_s'))} / {ms(p[f'gpu_{phase}_s'])} | "
                  f"{ms(m[f'host_{phase}_s'])} / {ms(p[f'host_{phase}_s'])} | {wall} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
