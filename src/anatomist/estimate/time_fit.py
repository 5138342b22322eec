"""Fit the time model's factors to measured steps: what `anatomist calibrate` and the published
calibration (benchmarks/published/fit.py) share.

A measured step is reduced to its *components*: for every kernel-launching op record, its
seconds at 100% of the datasheet peaks (tensor cores, CUDA cores, memory) and its calls per
optimizer step. The model (`estimate.time`) then predicts

    step_s = sum(calls x (max(tc_s / e_tc + cuda_s / e_fp32, memory_s / e_bw) + kernel_s)) + step_overhead_s

so the factors can be fitted, and held-back steps predicted, from the components alone, without
tracing again. The efficiencies are searched on a grid (coarse, then refined around the best
point); for each grid point the two overheads are the non-negative least-squares solution, the
step time being linear in them. The loss is the sum of squared relative errors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from anatomist.estimate.flops import StepOps
    from anatomist.hardware import GPU
    from anatomist.recipe import ResolvedRecipe


@dataclass(frozen=True, slots=True)
class Factors:
    """The five fitted numbers of the time model (see the module docstring)."""

    tensor_core_efficiency: float
    fp32_efficiency: float
    bandwidth_efficiency: float
    kernel_overhead_s: float
    step_overhead_s: float


@dataclass(frozen=True, slots=True)
class Components:
    """One step reduced to what the model needs: per op record (views left out), seconds at the
    datasheet peaks and calls per optimizer step."""

    tensor_core_s: np.ndarray
    cuda_core_s: np.ndarray
    memory_s: np.ndarray
    calls: np.ndarray

    def to_dict(self) -> dict[str, Any]:
        """Rounded to 4 significant digits (the stored inputs of benchmarks/published)."""
        return {k: [float(f"{v:.4g}") for v in getattr(self, k)] for k in ("tensor_core_s", "cuda_core_s", "memory_s", "calls")}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Components:
        return cls(**{k: np.asarray(data[k], dtype=np.float64) for k in ("tensor_core_s", "cuda_core_s", "memory_s", "calls")})


def components(ops: StepOps, recipe: ResolvedRecipe, gpu: GPU, *, optimizer_share: float = 1.0) -> Components:
    """The components of one optimizer step of `ops` on `gpu`.

    Args:
        optimizer_share: the fraction of the optimizer step this device runs (1/N when ZeRO or
            FSDP shards the optimizer state over N devices).
    """
    from anatomist.anatomy import Phase
    from anatomist.estimate.time import peak_seconds

    records = [r for r in ops.records if not r.view]
    peaks = np.array([peak_seconds(r, recipe, gpu) for r in records], dtype=np.float64).reshape(-1, 3)
    calls = np.array([r.calls_per_step(recipe.gradient_accumulation_steps)
                      * (optimizer_share if r.phase is Phase.OPTIMIZER else 1.0) for r in records])
    return Components(tensor_core_s=peaks[:, 0], cuda_core_s=peaks[:, 1], memory_s=peaks[:, 2], calls=calls)


def predict(c: Components, f: Factors) -> float:
    """Predicted seconds of the step `c` with factors `f`."""
    per_call = np.maximum(c.tensor_core_s / f.tensor_core_efficiency + c.cuda_core_s / f.fp32_efficiency,
                          c.memory_s / f.bandwidth_efficiency) + f.kernel_overhead_s
    return float(c.calls @ per_call) + f.step_overhead_s


COARSE = np.geomspace(0.02, 1.0, 25)
"""Efficiency grid of the first pass (ratio 1.18 between points)."""
BANDWIDTH_COARSE = np.geomspace(0.02, 8.0, 37)  # 8.0: calibration.MAX_BANDWIDTH_FACTOR
"""The bandwidth factor's grid: above 1 when the measured code moves less than the eager ops the
trace records (fused kernels: flash attention, fused LayerNorm/GELU, as the published runs use)."""


@dataclass(frozen=True, slots=True)
class _Flat:
    tc: np.ndarray
    cuda: np.ndarray
    mem: np.ndarray
    calls: np.ndarray
    row: np.ndarray
    kernels: np.ndarray  # calls per row
    n: int


def _flatten(steps: list[Components]) -> _Flat:
    row = np.concatenate([np.full(len(c.calls), i) for i, c in enumerate(steps)])

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(c, name) for c in steps])

    return _Flat(tc=cat("tensor_core_s"), cuda=cat("cuda_core_s"), mem=cat("memory_s"), calls=cat("calls"), row=row,
                 kernels=np.array([c.calls.sum() for c in steps]), n=len(steps))


def _overheads(rooflines: np.ndarray, kernels: np.ndarray, measured: np.ndarray,
               fixed: tuple[float, float] | None) -> tuple[float, float, float]:
    """(error, kernel_s, step_s) minimising sum(((roofline + k x kernels + s) / measured - 1)^2), k, s >= 0."""
    b = 1.0 - rooflines / measured
    if fixed is not None:
        k, s = fixed
        r = b - (k * kernels + s) / measured
        return float(r @ r), k, s
    a = np.stack([kernels / measured, 1.0 / measured], axis=1)
    candidates: list[tuple[float, float]] = [(0.0, 0.0)]
    solution, *_ = np.linalg.lstsq(a, b, rcond=None)
    if solution[0] >= 0 and solution[1] >= 0:
        candidates.append((float(solution[0]), float(solution[1])))
    for j in (0, 1):  # one overhead at 0, the other at its 1-D optimum
        col = a[:, j]
        x = max(0.0, float(col @ b / (col @ col))) if col @ col > 0 else 0.0
        candidates.append((x, 0.0) if j == 0 else (0.0, x))
    best = min(candidates, key=lambda ks: float(np.sum((b - a @ np.array(ks)) ** 2)))
    r = b - a @ np.array(best)
    return float(r @ r), best[0], best[1]


def fit(steps: list[Components], measured_s: list[float] | np.ndarray, *, base: Factors,
        fixed_overheads: bool = False) -> tuple[Factors, float]:
    """The factors that best predict `measured_s` (least squared relative error), and that error.

    An efficiency the steps cannot tell (no tensor-core work, or CUDA-core work under 5% of every
    step at the fp32 peak) keeps `base`'s value. With `fixed_overheads`, the two overheads keep `base`'s
    values too (a generation's refit on top of a pooled fit: too few rows to tell them).
    """
    if not steps:
        raise ValueError("fit needs at least one measured step")
    measured = np.asarray(measured_s, dtype=np.float64)
    flat = _flatten(steps)
    cuda_share = np.bincount(flat.row, weights=flat.calls * flat.cuda, minlength=flat.n) / measured
    free_tc = bool(np.any(flat.tc > 0))
    free_fp32 = bool(np.any(cuda_share > 0.05))
    fixed = (base.kernel_overhead_s, base.step_overhead_s) if fixed_overheads else None

    def evaluate(e_tc: float, e_fp32: float, e_bw: float) -> tuple[float, Factors]:
        per_call = np.maximum(flat.tc / e_tc + flat.cuda / e_fp32, flat.mem / e_bw)
        rooflines = np.bincount(flat.row, weights=flat.calls * per_call, minlength=flat.n)
        error, k, s = _overheads(rooflines, flat.kernels, measured, fixed)
        return error, Factors(tensor_core_efficiency=e_tc, fp32_efficiency=e_fp32, bandwidth_efficiency=e_bw,
                              kernel_overhead_s=k, step_overhead_s=s)

    def grids(center: Factors | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        def axis(free: bool, value: float, coarse: np.ndarray = COARSE) -> np.ndarray:
            if not free:
                return np.array([value])
            if center is None:
                return coarse
            return np.clip(value * np.geomspace(1 / 1.18, 1.18, 9), 1e-3, coarse[-1])
        c = center or base
        return (axis(free_tc, c.tensor_core_efficiency), axis(free_fp32, c.fp32_efficiency),
                axis(True, c.bandwidth_efficiency, BANDWIDTH_COARSE))

    best: tuple[float, Factors] | None = None
    for center in (None, "refine"):
        g_tc, g_fp32, g_bw = grids(None if center is None else best[1] if best else None)
        for e_tc in g_tc:
            for e_fp32 in g_fp32:
                for e_bw in g_bw:
                    result = evaluate(float(e_tc), float(e_fp32), float(e_bw))
                    if best is None or result[0] < best[0]:
                        best = result
    assert best is not None
    return best[1], best[0]


def relative_errors(steps: list[Components], measured_s: list[float] | np.ndarray, f: Factors) -> np.ndarray:
    """predicted / measured - 1 per step."""
    return np.array([predict(c, f) for c in steps]) / np.asarray(measured_s, dtype=np.float64) - 1.0


def replace(f: Factors, **changes: float) -> Factors:
    return dataclasses.replace(f, **changes)
