"""Part a: the runtime's own memory on this device, in a fresh process (nothing else on the GPU).

    python benchmarks/gpu/overhead.py --results RESULTS.jsonl --attempt ID [--dry-run]

What it measures, in order, each as one row of the results log:
  1. the CUDA context after init (a 1-element tensor, as the seeds do to see "the kernels
     alone take up 1.3GB"),
  2. after the first cuBLAS matmuls (fp32, bf16): handles and lazily loaded kernels outside the
     allocator, the cuBLAS workspace inside it,
  3. after cuDNN's first convolution, 4. after the first SDPA forward+backward,
  5. after two real training steps of bert-base-uncased (seq 512, batch 8, AdamW): what stays
     outside the allocator once a training step's kernels are loaded (the figure for the GPU
     catalog's `cuda_context_bytes`), and the allocator at the step's peak (segments, reserve)
     against anatomist's prediction,
  6. the caching allocator's rounding and segment sizes, one request at a time on an emptied
     cache, against anatomist's allocator model (`anatomist.trace.engine.allocator`).

"Outside the allocator" is NVML's device memory used, minus what it was before this process
touched CUDA, minus `torch.cuda.memory_reserved()`. With `--dry-run` (no CUDA) the same code
runs on the CPU with a tiny model; the CUDA counters are null and the rows say "dry-run".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from results import ResultsLog, quantity

PART = "a"
UNIT = "overhead"
ROUNDING_PROBES_BYTES = (1, 511, 513, 1 << 20, (1 << 20) + 1, (10 << 20) - 1, 10 << 20, (25 << 20) + 1)
"""Requests around the allocator's thresholds: 512 B blocks, 1 MiB small/large pool, 10 MiB
(a request of its own segment size from here on), 2 MiB rounding of large segments."""
STEP_MODEL = "bert-base-uncased"
STEP_SEQ_LEN = 512
STEP_BATCH = 8
TINY_BERT = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64, "vocab_size": 512, "max_position_embeddings": 64}


@dataclass(kw_only=True, slots=True)
class Reading:
    """Device memory at one moment (bytes); None for what this run cannot read."""

    outside_allocator_bytes: int | None
    """NVML used - NVML used before CUDA init - allocator reserved."""
    nvml_used_bytes: int | None
    mem_get_info_used_bytes: int | None
    """cudaMemGetInfo's total - free: a second source for the same device-wide figure."""
    allocated_bytes: int | None
    reserved_bytes: int | None


class Meter:
    """Reads NVML and the allocator; does nothing but say None in a dry run."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        self.handle: Any = None
        self.baseline_bytes: int | None = None
        if not dry_run:
            import pynvml

            pynvml.nvmlInit()
            self.pynvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.baseline_bytes = self._nvml_used()

    def _nvml_used(self) -> int:
        return int(self.pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def read(self) -> Reading:
        if self.dry_run:
            return Reading(outside_allocator_bytes=None, nvml_used_bytes=None, mem_get_info_used_bytes=None,
                           allocated_bytes=None, reserved_bytes=None)
        torch.cuda.synchronize()
        used = self._nvml_used()
        free, total = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        assert self.baseline_bytes is not None
        return Reading(outside_allocator_bytes=used - self.baseline_bytes - reserved, nvml_used_bytes=used,
                       mem_get_info_used_bytes=int(total - free), allocated_bytes=torch.cuda.memory_allocated(),
                       reserved_bytes=reserved)


def catalog_gpu(dry_run: bool) -> Any:
    """The catalog entry the prediction uses: the local GPU, or H100-SXM's code paths in a dry run."""
    from anatomist.hardware import detect_local_gpu, get_gpu

    gpu = None if dry_run else detect_local_gpu()
    return gpu if gpu is not None else get_gpu("H100-SXM")


def matmul_probe(x: torch.Tensor) -> None:
    """Stage 2: the first cuBLAS calls of this process, fp32 and bf16 (results freed at once)."""
    torch.mm(x, x)
    torch.mm(x.bfloat16(), x.bfloat16())


def cudnn_probe(device: torch.device) -> None:
    image = torch.randn(2, 3, 32, 32, device=device)
    conv = torch.nn.Conv2d(3, 8, 3).to(device)
    conv(image).sum().backward()


def sdpa_probe(device: torch.device) -> None:
    # [batch 2, heads 4, seq 128, head dim 64], bf16: the flash / memory-efficient kernels
    q, k, v = (torch.randn(2, 4, 128, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()


def step_workload(dry_run: bool, folder: Path) -> Any:
    from anatomist.workload_loader import load_workload

    if not dry_run:
        return load_workload(STEP_MODEL, seq_len=STEP_SEQ_LEN)
    (folder / "config.json").write_text(json.dumps(TINY_BERT))
    return load_workload(str(folder), seq_len=16)


def segments_summary() -> dict[str, Any]:
    """The allocator's segments: how many of each pool, their sizes, free bytes inside them."""
    stats = torch.cuda.memory_stats()
    sizes: dict[str, list[int]] = {"small": [], "large": []}
    for seg in torch.cuda.memory_snapshot():
        sizes.setdefault(str(seg.get("segment_type", "large")), []).append(int(seg["total_size"]))
    return {
        "small_segments": len(sizes["small"]), "large_segments": len(sizes["large"]),
        "large_segment_bytes": sorted(sizes["large"], reverse=True)[:32],
        "inactive_split_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
        "peak_segments": int(stats.get("segment.all.peak", 0)),
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
    }


def training_step_rows(log: ResultsLog, attempt: str, meter: Meter, dry_run: bool, context_predicted: int) -> None:
    """Stage 5: two real steps, the second measured; prediction and catalog figure beside it."""
    from anatomist.estimate import estimate_memory
    from anatomist.measure.profile import training_step
    from anatomist.recipe import Recipe

    device = torch.device("cpu" if dry_run else "cuda")
    recipe = Recipe(per_device_train_batch_size=2 if dry_run else STEP_BATCH)
    with tempfile.TemporaryDirectory(prefix="validate-overhead-") as tmp:
        workload = step_workload(dry_run, Path(tmp))
        step = training_step(workload, recipe, device)
        step()  # creates the optimizer state and loads every kernel the step uses
        if not dry_run:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        step()
        after = meter.read()
        predicted: dict[str, Any] = {}
        note = None
        if dry_run:
            note = "dry-run: prediction left out to keep the CPU run short (part d exercises estimate_memory)"
        else:
            predicted = estimate_memory(workload, recipe.resolved(workload), catalog_gpu(dry_run)).anatomy.to_dict()
    peak_allocated = None if dry_run else torch.cuda.max_memory_allocated()
    peak_reserved = None if dry_run else torch.cuda.max_memory_reserved()
    outside = after.outside_allocator_bytes
    device_total = None if peak_reserved is None or outside is None else peak_reserved + outside
    log.row(part=PART, unit=UNIT, attempt=attempt, name="after-training-step", status="ok",
            mode="dry-run" if dry_run else "gpu", reason=note,
            quantities={
                "outside_allocator_bytes": quantity(context_predicted, outside),
                "peak_allocated_bytes": quantity(predicted.get("peak_allocated"), peak_allocated),
                "peak_reserved_bytes": quantity(predicted.get("peak_reserved"), peak_reserved),
                "device_total_bytes": quantity(predicted.get("device_total"), device_total),
            },
            details={"model": workload.name, "seq_len": workload.seq_len, "recipe": recipe.to_dict(),
                     "reading": _asdict(after),
                     "segments": None if dry_run else segments_summary(),
                     "predicted_source": "anatomist.estimate.estimate_memory; outside_allocator predicted = the "
                                         "GPU catalog's cuda_context_bytes"})


def _asdict(reading: Reading) -> dict[str, Any]:
    return {f: getattr(reading, f) for f in Reading.__slots__}  # type: ignore[attr-defined]


def rounding_rows(log: ResultsLog, attempt: str, dry_run: bool) -> None:
    """Stage 6: one request at a time on an emptied cache: the block and the segment it gets."""
    from anatomist.trace.engine.allocator import round_size, segment_size

    for nbytes in ROUNDING_PROBES_BYTES:
        measured_block = measured_segment = None
        if not dry_run:
            gc.collect()
            torch.cuda.empty_cache()
            allocated0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            measured_block = torch.cuda.memory_allocated() - allocated0
            measured_segment = torch.cuda.memory_reserved() - reserved0
            del block
        else:
            torch.empty(nbytes, dtype=torch.uint8)
        log.row(part=PART, unit=UNIT, attempt=attempt, name=f"allocator-request-{nbytes}", status="ok",
                mode="dry-run" if dry_run else "gpu",
                reason="dry-run: no CUDA allocator to ask" if dry_run else None,
                quantities={"block_bytes": quantity(round_size(nbytes), measured_block),
                            "new_segment_bytes": quantity(segment_size(round_size(nbytes)), measured_segment)},
                details={"request_bytes": nbytes,
                         "note": "new_segment_bytes is 0 when a cached segment had room (not a rounding error)"})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--attempt", required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    log, dry = ResultsLog(path=args.results), args.dry_run
    meter = Meter(dry)  # NVML's baseline first: before anything of this process can touch CUDA
    mode = "dry-run" if dry else "gpu"
    from anatomist.hardware import cublas_workspace_bytes

    gpu = catalog_gpu(dry)
    context_predicted = gpu.cuda_context_bytes
    device = torch.device("cpu" if dry else "cuda")

    def stage(name: str, quantities: dict[str, Any], details: dict[str, Any]) -> None:
        log.row(part=PART, unit=UNIT, attempt=args.attempt, name=name, status="ok", mode=mode,
                reason="dry-run: CUDA counters not read (no GPU)" if dry else None,
                quantities=quantities, details=details)
        print(f"validate a: {name} recorded", file=sys.stderr)

    torch.empty(1, device=device)
    context = meter.read()
    stage("context-after-init", {"outside_allocator_bytes": quantity(context_predicted, context.outside_allocator_bytes)},
          {"reading": _asdict(context), "baseline_nvml_used_bytes": meter.baseline_bytes,
           "catalog_gpu": gpu.name, "catalog_source": gpu.cuda_context_source,
           "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING")})
    x = torch.randn(1024, 1024, device=device)
    before = meter.read()
    matmul_probe(x)
    cublas = meter.read()
    workspace_measured = None
    if cublas.allocated_bytes is not None and before.allocated_bytes is not None:
        workspace_measured = cublas.allocated_bytes - before.allocated_bytes  # what the matmuls left allocated
    stage("after-first-cublas-matmul",
          {"outside_allocator_bytes": quantity(context_predicted, cublas.outside_allocator_bytes),
           "cublas_workspace_bytes": quantity(cublas_workspace_bytes(gpu.compute_capability), workspace_measured)},
          {"reading": _asdict(cublas), "before": _asdict(before),
           "note": "cublas_workspace_bytes: allocator bytes still allocated after the first matmuls (main thread)"})
    del x
    cudnn_probe(device)
    cudnn = meter.read()
    stage("after-cudnn-init", {"outside_allocator_bytes": quantity(context_predicted, cudnn.outside_allocator_bytes)},
          {"reading": _asdict(cudnn), "cudnn_version": torch.backends.cudnn.version() if not dry else None})
    sdpa_probe(device)
    sdpa = meter.read()
    stage("after-first-sdpa", {"outside_allocator_bytes": quantity(context_predicted, sdpa.outside_allocator_bytes)},
          {"reading": _asdict(sdpa)})
    training_step_rows(log, args.attempt, meter, dry, context_predicted)
    print("validate a: after-training-step recorded", file=sys.stderr)
    gc.collect()
    rounding_rows(log, args.attempt, dry)
    print("validate a: allocator requests recorded", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
