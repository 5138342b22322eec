"""Predict the time of one training step from its ops: a roofline per op, offline.

Each op of the traced step (`flops.step_ops`: FLOPs and bytes moved per call, fake
tensors) takes

    max(flops / (peak(dtype) x efficiency), bytes / (bandwidth x bandwidth_efficiency)) + launch

on the target GPU. The peak follows the precision the op's kernel runs in: fp16/bf16 tensor
cores for matrix products under autocast, TF32 when the recipe allows it and the GPU has it,
else fp32; normalizations stay in fp32 under autocast, as the trace shows. The micro-batch's
forward and backward repeat `gradient_accumulation_steps` times; gradient checkpointing's
recomputation is already in the traced backward; the optimizer step runs once and is
bytes-bound (foreach AdamW's kernels read and write weights, gradients and both moments).

The efficiency factors live in data/time_calibration.toml; until they come from a GPU run
they are placeholders and every result says `calibrated = False`.

Known limitations: kernels are assumed not to overlap and the CPU is assumed to keep the
GPU fed (no data-loading or host stalls); a fused kernel (fused AdamW, flash attention) is
costed as the ops the trace records.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources

from anatomist.anatomy import OpClass, Phase, TimeAnatomy
from anatomist.estimate.flops import OpRecord, StepOps, step_ops
from anatomist.hardware import GPU, Precision
from anatomist.recipe import Recipe
from anatomist.workload import Workload


@dataclass(kw_only=True, slots=True, frozen=True)
class Calibration:
    """Efficiency factors of the roofline (data/time_calibration.toml)."""

    calibrated: bool
    """False while the factors are placeholders not fitted to a GPU run."""
    source: str
    contraction_tensor_core_efficiency: float
    contraction_fp32_efficiency: float
    bandwidth_efficiency: float
    launch_overhead_s: float


@cache
def calibration() -> Calibration:
    raw = tomllib.loads(resources.files("anatomist.data").joinpath("time_calibration.toml").read_text())
    return Calibration(**raw)


def recipe_precision(recipe: Recipe, gpu: GPU) -> Precision:
    """The dtype whose dense peak the recipe's matrix products run at (the MFU denominator)."""
    if recipe.fp16:
        return "fp16"
    if recipe.bf16:
        return "bf16"
    return "tf32" if recipe.tf32 and gpu.tf32 else "fp32"


def _contraction_peak_flops(record: OpRecord, recipe: Recipe, gpu: GPU, cal: Calibration) -> float:
    """FLOP/s an op's matrix product reaches: dtype peak x efficiency."""
    if record.dtype in ("float16", "bfloat16"):
        precision: Precision = "fp16" if record.dtype == "float16" else "bf16"
    else:
        precision = "tf32" if recipe.tf32 and gpu.tf32 else "fp32"
    efficiency = cal.contraction_fp32_efficiency if precision == "fp32" else cal.contraction_tensor_core_efficiency
    return gpu.peak_tflops(precision) * 1e12 * efficiency


def op_call_s(record: OpRecord, recipe: Recipe, gpu: GPU, cal: Calibration | None = None) -> float:
    """Predicted seconds of one call of `record` on `gpu` (0 for views: no kernel)."""
    cal = cal or calibration()
    if record.view:
        return 0.0
    memory_s = record.bytes / (gpu.bandwidth_gbps * 1e9 * cal.bandwidth_efficiency)
    if record.flops > 0:
        compute_s = record.flops / _contraction_peak_flops(record, recipe, gpu, cal)
    else:  # the approximate arithmetic of other ops runs on CUDA cores
        compute_s = record.approx_flops / (gpu.fp32_tflops * 1e12 * cal.contraction_fp32_efficiency)
    return max(compute_s, memory_s) + cal.launch_overhead_s


def time_from_ops(ops: StepOps, workload: Workload, recipe: Recipe, gpu: GPU) -> TimeAnatomy:
    """Add the per-op roofline times of `ops` up into a step's TimeAnatomy."""
    cal = calibration()
    accumulation = recipe.gradient_accumulation_steps
    phases = dict.fromkeys((Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER), 0.0)
    classes = dict.fromkeys(OpClass, 0.0)
    for record in ops.records:
        repeats = record.count * (1 if record.phase is Phase.OPTIMIZER else accumulation)
        seconds = op_call_s(record, recipe, gpu, cal) * repeats
        phases[record.phase] += seconds
        classes[record.op_class] += seconds
    step_s = sum(phases.values())
    flops = round(accumulation * (ops.flops(Phase.FORWARD) + ops.flops(Phase.BACKWARD)) + ops.flops(Phase.OPTIMIZER))
    samples = recipe.per_device_train_batch_size * accumulation
    peak = gpu.peak_tflops(recipe_precision(recipe, gpu)) * 1e12
    return TimeAnatomy(
        step_s=step_s,
        samples_per_second=samples / step_s,
        tokens_per_second=samples * workload.seq_len / step_s,
        flops_per_step=flops,
        mfu=flops / step_s / peak,
        phases_s={str(p): s for p, s in phases.items()},
        classes_s={str(c): s for c, s in classes.items()},
        calibrated=cal.calibrated,
    )


def estimate_time(workload: Workload, recipe: Recipe, gpu: GPU) -> TimeAnatomy:
    """Predicted time of one optimizer step of `recipe` on `gpu` (see the module docstring)."""
    return time_from_ops(step_ops(workload, recipe), workload, recipe, gpu)


def achieved(flops_per_step: int, step_s: float, recipe: Recipe, gpu: GPU) -> tuple[float, float]:
    """Achieved TFLOP/s and MFU of a measured step against the GPU's dense peak for the recipe's dtype."""
    tflops = flops_per_step / step_s / 1e12
    return tflops, tflops / gpu.peak_tflops(recipe_precision(recipe, gpu))
