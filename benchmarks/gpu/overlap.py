"""Part a: how the host's issuing and the GPU's work overlap in forward and backward, with and without checkpointing.

    python benchmarks/gpu/overlap.py --results RESULTS.jsonl --attempt ID [--model MODEL] [--seq-len N]
                                     [--batches 1,2,4] [--dry-run]

The time model takes each phase as the slower of the GPU's work and the host's issuing of it (`roofline.phase_s`).
On a lent H200 (benchmarks/gpu/H200) checkpointing added 68-70 ms to Llama-3.2-1B's bf16 Trainer step at 4 x 1,024
tokens, full and LoRA alike, where that model adds 17 ms (full) and 55 ms (LoRA). Two readings fit: the recomputed
forward's issuing does not overlap the GPU, or it costs the host about four forward kernels' worth each instead of
two. Which one is what this measures, per setting (the task model built at random in bf16 weights on the GPU, bf16
autocast as the Trainer's `bf16=True` runs it, SDPA,
checkpointing off or on through transformers' own `gradient_checkpointing_enable`, each batch size):

- the host's issue time of forward and of backward: `perf_counter` around `model(**batch).loss` and around
  `loss.backward()`, without synchronizing (after one synchronize before forward), median of 3;
- the wall time of both: the same, then a synchronize;
- the GPU's busy time and its kernels per phase: torch.profiler over one forward and one forward + backward (the
  sum of the CUDA kernels' and copies' own device time, and their count; backward = the difference), and each
  profiled pass's span from its first kernel's start to its last one's end: span - busy is the GPU waiting on the host.

Nothing is predicted here (tracing each setting would take longer than measuring it): `overlap_report.py` sets this
tree's per-phase kernels and times beside these rows offline, as repredict.py does for the bench rows. `--dry-run` runs the same
code on the CPU with a tiny model: the host times are CPU times and the GPU's figures are null.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from fwd_bwd import Device, build
from results import ResultsLog, quantity

PART = "a"
UNIT = "host-overlap"
TIMED_REPEATS = 3


def loss_of(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The Trainer's forward with `bf16=True`: under bf16 autocast (the llama-1b bench rows' recipe)."""
    with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16):
        return model(**batch).loss


def issue_and_wall(model: Any, batch: dict[str, torch.Tensor], on: Device) -> dict[str, float]:
    """One forward and backward: the host's time to issue each, and the wall time once the GPU is done."""
    on.sync()
    start = time.perf_counter()
    loss = loss_of(model, batch)
    forward_issued = time.perf_counter()
    loss.backward()
    backward_issued = time.perf_counter()
    on.sync()
    done = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return {"host_forward_s": forward_issued - start, "host_backward_s": backward_issued - forward_issued,
            "wall_s": done - start}


def device_work(model: Any, batch: dict[str, torch.Tensor], backward: bool) -> tuple[float, int, float]:
    """The GPU's busy seconds, kernels (and copies), and the span from the first one's start to the last one's end
    (busy + the GPU's idle waits on the host) of one forward (and backward), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loss = loss_of(model, batch)
        if backward:
            loss.backward()
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    span = max(e.time_range.end for e in device) - min(e.time_range.start for e in device)
    return sum(e.device_time for e in device) * 1e-6, len(device), span * 1e-6


def measure(model: Any, batch: dict[str, torch.Tensor], on: Device) -> dict[str, Any]:
    issue_and_wall(model, batch, on)  # warm-up: kernels loaded, cuBLAS workspaces, the allocator's cache
    runs = [issue_and_wall(model, batch, on) for _ in range(TIMED_REPEATS)]
    out: dict[str, Any] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    out.update(gpu_forward_s=None, gpu_backward_s=None, kernels_forward=None, kernels_backward=None)
    if on.cuda:
        try:
            forward_s, forward_kernels, forward_span_s = device_work(model, batch, backward=False)
            both_s, both_kernels, both_span_s = device_work(model, batch, backward=True)
        except Exception as exc:  # noqa: BLE001 - the host's figures stand without the profiler's
            out["profiler_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        else:
            out.update(gpu_forward_s=forward_s, gpu_backward_s=both_s - forward_s, kernels_forward=forward_kernels,
                       kernels_backward=both_kernels - forward_kernels, gpu_span_forward_s=forward_span_s,
                       gpu_span_both_s=both_span_s)
    return out


def run(args: argparse.Namespace) -> None:
    from anatomist.trace.step.inputs import make_batch
    from anatomist.workload_loader import load_workload

    log, on = ResultsLog(path=args.results), Device(args.dry_run)
    workload = load_workload(args.model, seq_len=args.seq_len, task="causal-lm")
    model = build(workload, "sdpa", "bf16", on)
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        for batch_size in sorted(args.batches):
            name = f"{'checkpointing' if checkpointing else 'plain'}/b{batch_size}"
            details: dict[str, Any] = {"model": args.model, "seq_len": args.seq_len, "batch": batch_size,
                                       "checkpointing": checkpointing, "dtype": "bfloat16", "bf16": True, "attn": "sdpa"}
            row = {"part": PART, "unit": args.unit, "attempt": args.attempt, "name": name,
                   "mode": "dry-run" if args.dry_run else "gpu"}
            try:
                batch = {k: v.to(on.torch_device) for k, v in make_batch(workload, batch_size).items()}
                measured = measure(model, batch, on)
            except torch.cuda.OutOfMemoryError as exc:
                log.row(**row, status="oom", reason=str(exc).splitlines()[0], details=details)
                break
            log.row(**row, status="ok", details={**details, "measured": measured},
                    reason="dry-run: CPU times, no GPU figures" if args.dry_run else None,
                    quantities={key: quantity(None, measured[key]) for key in
                                ("wall_s", "host_forward_s", "host_backward_s", "gpu_forward_s", "gpu_backward_s")})
            print(f"validate a: {args.unit} {name} recorded", file=sys.stderr)
            del batch
            on.free_all()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--attempt", required=True)
    parser.add_argument("--unit", default=UNIT)
    parser.add_argument("--model", default="Llama-3.2-1B", help="catalog name or config folder (a causal LM)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batches", type=lambda text: [int(x) for x in text.split(",") if x], default=[1, 2, 4])
    parser.add_argument("--dry-run", action="store_true")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
