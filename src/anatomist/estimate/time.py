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
MFU counts the model FLOPs (the step without gradient checkpointing), HFU the hardware FLOPs
(recomputation included): `flops.step_flops`.

The efficiency factors live in data/time_calibration.toml; until they come from a GPU run
they are placeholders and every result says `calibrated = False`.

Known limitations: kernels are assumed not to overlap and the CPU is assumed to keep the
GPU fed (no data-loading or host stalls); a fused kernel (fused AdamW, flash attention) is
costed as the ops the trace records.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources
from pathlib import Path

import numpy as np

from anatomist.anatomy import OpClass, Phase, TimeAnatomy
from anatomist.axes.precisions import matmul_precision
from anatomist.errors import InputError
from anatomist.estimate.flops import OpRecord, StepOps, step_flops, step_ops
from anatomist.hardware import GPU, Precision
from anatomist.recipe import ResolvedRecipe
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


def load_calibration(path: str | Path) -> Calibration:
    """A calibration file as `anatomist calibrate` writes it (`--calibration FILE`).

    Raises:
        InputError: missing, not TOML, or without the factors.
    """
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"calibration file {str(p)!r} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, IsADirectoryError) as exc:
        raise InputError(f"{p}: not a calibration file ({exc})") from None
    names = [f.name for f in fields(Calibration)]
    missing = [n for n in names if n not in raw]
    if missing:
        raise InputError(f"{p}: not a calibration file (missing {', '.join(missing)}); write one with `anatomist calibrate`")
    cal = Calibration(**{n: raw[n] for n in names})
    factors = (cal.contraction_tensor_core_efficiency, cal.contraction_fp32_efficiency, cal.bandwidth_efficiency)
    if not all(isinstance(f, (int, float)) and 0 < f <= 1 for f in factors) or cal.launch_overhead_s < 0:
        raise InputError(f"{p}: efficiencies must be in (0, 1] and the launch overhead >= 0")
    return cal


def calibration_toml(cal: Calibration) -> str:
    """`cal` as a calibration file (the format of data/time_calibration.toml)."""
    return "\n".join([
        "# Efficiency factors of anatomist's roofline time model; use with --calibration FILE.",
        f"calibrated = {str(cal.calibrated).lower()}",
        f"source = {json.dumps(cal.source)}",
        f"contraction_tensor_core_efficiency = {cal.contraction_tensor_core_efficiency!r}",
        f"contraction_fp32_efficiency = {cal.contraction_fp32_efficiency!r}",
        f"bandwidth_efficiency = {cal.bandwidth_efficiency!r}",
        f"launch_overhead_s = {cal.launch_overhead_s!r}",
        "",
    ])


def _peak_seconds(record: OpRecord, recipe: ResolvedRecipe, gpu: GPU) -> tuple[float, float, float]:
    """(tensor-core, CUDA-core, memory) seconds of one call at 100% of the datasheet peaks.

    A matrix product runs at the peak of its dtype: fp16/bf16 under autocast, TF32 where the
    recipe allows it and the GPU has it (tensor cores), else fp32 (CUDA cores). The
    approximate arithmetic of other ops runs on CUDA cores.
    """
    memory_s = record.bytes / (gpu.bandwidth_gbps * 1e9)
    if record.flops <= 0:
        return 0.0, record.approx_flops / (gpu.fp32_tflops * 1e12), memory_s
    if record.dtype in ("float16", "bfloat16"):
        precision: Precision = "fp16" if record.dtype == "float16" else "bf16"
    else:
        precision = "tf32" if recipe.tf32 and gpu.tf32 else "fp32"
    # A GPU without tensor cores for the dtype still runs it, at most at its fp32 rate.
    seconds = record.flops / ((gpu.peak_tflops(precision) or gpu.fp32_tflops) * 1e12)
    return (0.0, seconds, memory_s) if precision == "fp32" else (seconds, 0.0, memory_s)


def op_call_s(record: OpRecord, recipe: ResolvedRecipe, gpu: GPU, cal: Calibration | None = None) -> float:
    """Predicted seconds of one call of `record` on `gpu` (0 for views: no kernel)."""
    cal = cal or calibration()
    if record.view:
        return 0.0
    tensor_core_s, cuda_core_s, memory_s = _peak_seconds(record, recipe, gpu)
    compute_s = tensor_core_s / cal.contraction_tensor_core_efficiency + cuda_core_s / cal.contraction_fp32_efficiency
    return max(compute_s, memory_s / cal.bandwidth_efficiency) + cal.launch_overhead_s


def time_from_ops(
    ops: StepOps, workload: Workload, recipe: ResolvedRecipe, gpu: GPU, cal: Calibration | None = None
) -> TimeAnatomy:
    """Add the per-op roofline times of `ops` up into a step's TimeAnatomy (`cal`: the
    factors to use; default data/time_calibration.toml)."""
    cal = cal or calibration()
    accumulation = recipe.gradient_accumulation_steps
    phases = dict.fromkeys((Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER), 0.0)
    classes = dict.fromkeys(OpClass, 0.0)
    for record in ops.records:
        seconds = op_call_s(record, recipe, gpu, cal) * record.calls_per_step(accumulation)
        phases[record.phase] += seconds
        classes[record.op_class] += seconds
    step_s = sum(phases.values())
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
        phases_s={str(p): s for p, s in phases.items()},
        classes_s={str(c): s for c, s in classes.items()},
        calibrated=cal.calibrated,
    )


def estimate_time(workload: Workload, recipe: ResolvedRecipe, gpu: GPU, cal: Calibration | None = None) -> TimeAnatomy:
    """Predicted time of one optimizer step of `recipe` on `gpu` (see the module docstring)."""
    return time_from_ops(step_ops(workload, recipe, gpu.compute_capability), workload, recipe, gpu, cal)


@dataclass(frozen=True, slots=True)
class TimedStep:
    """A measured step for `fit_calibration`: what ran, where, and its seconds per optimizer step."""

    workload: Workload
    recipe: ResolvedRecipe
    gpu: GPU
    step_s: float


EFFICIENCY_GRID = np.geomspace(1e-3, 1.0, 61)


def fit_calibration(steps: list[TimedStep], *, source: str) -> Calibration:
    """The roofline factors that best predict `steps` (least squared relative error).

    A grid over the contraction efficiency (one factor: tensor cores if any step runs its
    matrix products on them, else CUDA cores; the other keeps its current value) and the
    bandwidth efficiency; for each pair the launch overhead is the closed-form least-squares
    solution (clipped at 0), a step's time being linear in it. `calibrated` is True: the
    caller vouches that `steps` were measured.
    """
    if not steps:
        raise ValueError("fit_calibration needs at least one measured step")
    base = calibration()
    tensor_cores = any(matmul_precision(s.recipe, s.gpu) != "fp32" for s in steps)
    measured = np.array([s.step_s for s in steps])
    peaks, repeats, launches = [], [], []
    for s in steps:
        records = [r for r in step_ops(s.workload, s.recipe, s.gpu.compute_capability).records if not r.view]
        peaks.append(np.array([_peak_seconds(r, s.recipe, s.gpu) for r in records]).reshape(-1, 3))
        repeats.append(np.array([r.calls_per_step(s.recipe.gradient_accumulation_steps) for r in records]))
        launches.append(repeats[-1].sum())
    a = np.array(launches) / measured
    best: tuple[float, float, float, float] | None = None  # error, contraction, bandwidth, launch
    for contraction in EFFICIENCY_GRID:
        tc = contraction if tensor_cores else base.contraction_tensor_core_efficiency
        cuda = base.contraction_fp32_efficiency if tensor_cores else contraction
        for bandwidth in EFFICIENCY_GRID:
            rooflines = np.array([
                rep @ np.maximum(p[:, 0] / tc + p[:, 1] / cuda, p[:, 2] / bandwidth)
                for p, rep in zip(peaks, repeats, strict=True)
            ])
            # minimise sum(((roofline + L x launches) / measured - 1)^2) over L >= 0
            r = rooflines / measured - 1
            launch = max(0.0, float(-(a @ r) / (a @ a))) if a @ a > 0 else 0.0
            error = float(np.sum((r + launch * a) ** 2))
            if best is None or error < best[0]:
                best = (error, float(contraction), float(bandwidth), launch)
    assert best is not None
    _, contraction, bandwidth, launch = best
    return Calibration(
        calibrated=True, source=source, bandwidth_efficiency=bandwidth, launch_overhead_s=launch,
        contraction_tensor_core_efficiency=contraction if tensor_cores else base.contraction_tensor_core_efficiency,
        contraction_fp32_efficiency=base.contraction_fp32_efficiency if tensor_cores else contraction,
    )
