"""Predict the time of one training step from its ops: a roofline per op, offline.

Each op of the traced step (`ops.step_ops`: FLOPs and bytes moved per call, fake
tensors; with torch.compile, each fused kernel: `trace.step.compiled`) takes

    max(flops / (peak(dtype) x efficiency), bytes / (bandwidth x bandwidth_efficiency)) + kernel overhead

on the target GPU (`roofline.kernel_s`). The peak follows the precision the op's kernel runs in: fp16/bf16 tensor
cores for matrix products under autocast, TF32 when the recipe allows it and the GPU has it,
else fp32; normalizations stay in fp32 under autocast, as the trace shows. The micro-batch's
forward and backward repeat `gradient_accumulation_steps` times; gradient checkpointing's
recomputation is already in the traced backward; the optimizer step runs once and is
bytes-bound (foreach AdamW's kernels read and write weights, gradients and both moments).
MFU counts the model FLOPs (the step without gradient checkpointing), HFU the hardware FLOPs
(recomputation included): `ops.step_flops`.

A phase (forward, backward, optimizer) takes at least the host's time to issue its kernels, one by
one (`roofline.phase_s`): a small batch or a Python loop over the parameters (Adafactor, a for-loop
AdamW) is bound by the host, not the GPU. Each micro-batch adds the host's own time (the training
loop's Python, the batch's collation and copy). The factors (`roofline.Factors` in a `lookup.Calibration`) come from the lookup of
`lookup.calibration_for`: the user's measured calibration of the GPU if any, else the
published calibration of its generation, fitted to published training runs
(benchmarks/published) with its cross-validated error.

Known limitations: kernels are assumed not to overlap; an eager fused kernel (fused AdamW, flash
attention) is costed as the ops the trace records; the published runs the factors are fitted on
run fused LayerNorm and GELU kernels (NVIDIA's BERT) and fused cross-entropy (llm-foundry) that
their traces record as eager ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anatomist.anatomy import OpClass, Phase, TimeAnatomy
from anatomist.calibration.lookup import Calibration, calibration_for
from anatomist.estimate.intervals import time_interval
from anatomist.estimate.time.ops import OpRecord, StepOps, recomputed_kernels, step_flops, step_ops
from anatomist.estimate.time.roofline import host_kernels, kernel_s, phase_s
from anatomist.estimate.time.tiles import busy_fraction
from anatomist.hardware import GPU, Precision
from anatomist.recipe import ResolvedRecipe
from anatomist.recipe.axis_values import matmul_precision
from anatomist.trace.engine.records import ATTENTION_PREFIX, NOT_DEVICE_COMPUTE
from anatomist.workload import Workload


def peak_seconds(record: OpRecord, recipe: ResolvedRecipe, gpu: GPU) -> tuple[float, float, float]:
    """(tensor-core, CUDA-core, memory) seconds of one call at 100% of the datasheet peaks.

    A matrix product runs at the peak of its dtype: fp16/bf16 under autocast, FP8 (torchao's float8 layers), TF32 where the
    recipe allows it and the GPU has it (tensor cores), else fp32 (CUDA cores), on the share of the GPU its shape
    keeps busy (`tiles.busy_fraction`). The approximate arithmetic of other ops runs on CUDA cores.
    """
    memory_s = record.bytes / (gpu.bandwidth_gbps * 1e9)
    if record.flops <= 0:
        return 0.0, record.approx_flops / (gpu.fp32_tflops * 1e12), memory_s
    if record.dtype in ("float16", "bfloat16"):
        precision: Precision = "fp16" if record.dtype == "float16" else "bf16"
    elif record.dtype.startswith("float8"):  # torchao's Float8Linear: torch._scaled_mm
        precision = "fp8"
    else:
        precision = "tf32" if recipe.tf32 and gpu.tf32 else "fp32"
    # A GPU without tensor cores for the dtype still runs it, at most at its fp32 rate.
    peak = gpu.peak_tflops(precision)
    busy = busy_fraction(record.gemm, gpu.sm_count, tensor_cores=precision != "fp32" and peak > 0,
                         attention=record.name.startswith(ATTENTION_PREFIX))
    seconds = record.flops / ((peak or gpu.fp32_tflops) * 1e12 * busy)
    return (0.0, seconds, memory_s) if precision == "fp32" else (seconds, 0.0, memory_s)


def op_call_s(record: OpRecord, recipe: ResolvedRecipe, gpu: GPU, cal: Calibration | None = None) -> float:
    """Predicted seconds of one call of `record` on `gpu` (0 for views: no kernel)."""
    if record.view:
        return 0.0
    return float(kernel_s(*peak_seconds(record, recipe, gpu), (cal or calibration_for(gpu)).factors))


@dataclass(frozen=True, slots=True)
class PhaseWork:
    """What each phase of a step (forward, backward, optimizer; accumulation's micro-batches in) asks of the GPU and
    of the host, before `roofline.phase_s` takes the slower of the two."""

    gpu_s: dict[Phase, float]
    """Its kernels' GPU seconds."""
    kernels: dict[Phase, float]
    """Its kernel calls."""
    host_kernels: np.ndarray
    """Its kernels in forward kernels' worth of the host's time (`roofline.host_kernels`), in `gpu_s`'s order."""
    classes: dict[OpClass, float]
    """The GPU seconds of each operation class."""


def phase_work(ops: StepOps, workload: Workload, recipe: ResolvedRecipe, gpu: GPU, cal: Calibration) -> PhaseWork:
    """Each kernel of `ops` priced on `gpu` at `cal`'s factors and counted for the host, per phase (collectives left
    to `cluster.time_across_devices`)."""
    accumulation = recipe.gradient_accumulation_steps
    gpu_s = dict.fromkeys((Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER), 0.0)
    kernels = dict.fromkeys(gpu_s, 0.0)
    classes = dict.fromkeys(OpClass, 0.0)
    for record in ops.records:
        if record.view or record.name.startswith(NOT_DEVICE_COMPUTE):
            continue
        calls = record.calls_per_step(accumulation)
        seconds = op_call_s(record, recipe, gpu, cal) * calls
        gpu_s[record.phase] += seconds
        kernels[record.phase] += calls
        classes[record.op_class] += seconds
    weighted = host_kernels(np.array(list(kernels.values())), recomputed_kernels(workload, recipe, gpu.compute_capability)
                            * accumulation)
    return PhaseWork(gpu_s=gpu_s, kernels=kernels, host_kernels=weighted, classes=classes)


def time_from_ops(
    ops: StepOps, workload: Workload, recipe: ResolvedRecipe, gpu: GPU, cal: Calibration | None = None
) -> TimeAnatomy:
    """Add the per-kernel times of `ops` up into a step's TimeAnatomy: each phase the slower of its kernels' GPU time
    and the host's time to issue them (`phase_work`, `roofline.phase_s`), plus the host's time per micro-batch
    (`cal`: the factors to use; default `calibration_for(gpu)`). Where the host is the bound, the GPU's idle time
    counts as `other` (the host's, as the time per micro-batch)."""
    cal = cal or calibration_for(gpu)
    accumulation = recipe.gradient_accumulation_steps
    work = phase_work(ops, workload, recipe, gpu, cal)
    gpu_s, classes = work.gpu_s, dict(work.classes)
    phases = {p: float(phase_s(gpu_s[p], work.host_kernels[i], cal.factors)) for i, p in enumerate(gpu_s)}
    host_s = cal.factors.micro_batch_overhead_s * accumulation
    step_s = sum(phases.values()) + host_s
    # the training loop's own time, and the GPU's waiting for the host: no op class of their own
    classes[OpClass.OTHER] += host_s + sum(phases[p] - gpu_s[p] for p in phases)
    flops = step_flops(workload, recipe, gpu.compute_capability, ops=ops)
    samples = recipe.per_device_train_batch_size * accumulation
    # A GPU without tensor cores for the dtype (bf16 on a V100) runs it at its fp32 rate at best.
    peak = (gpu.peak_tflops(matmul_precision(recipe, gpu)) or gpu.fp32_tflops) * 1e12
    mfu, hfu = flops.utilization(step_s, peak)
    return TimeAnatomy(
        step_s=step_s,
        samples_per_second=samples / step_s,
        tokens_per_second=samples * workload.seq_len / step_s,
        flops_per_step=flops.model,
        hardware_flops_per_step=flops.hardware,
        mfu=mfu,
        hfu=hfu,
        phases_s={**{str(p): s for p, s in phases.items()}, "host overhead": host_s},
        classes_s={str(c): s for c, s in classes.items()},
        calibrated=cal.calibrated,
        calibration=cal.describe(),
        error_median_pct=cal.error.median_error_pct if cal.error else None,
        error_worst_pct=cal.error.worst_error_pct if cal.error else None,
        interval=time_interval(step_s, cal, recipe),
    )


def estimate_time(workload: Workload, recipe: ResolvedRecipe, gpu: GPU, cal: Calibration | None = None) -> TimeAnatomy:
    """Predicted time of one optimizer step of `recipe` on `gpu` (see the module docstring)."""
    return time_from_ops(step_ops(workload, recipe, gpu.compute_capability), workload, recipe, gpu, cal)
