"""Fit the time model's factors to measured steps: what `anatomist calibrate` and the published
calibration (benchmarks/published/fit.py) share.

A measured step is reduced to its *components*: for every kernel-launching op record, its
seconds at 100% of the datasheet peaks (tensor cores, CUDA cores, memory) and its calls per
optimizer step, and the micro-batches the step runs. The model (`time_model`) then predicts

    step_s = sum(calls x kernel_s(tc_s, cuda_s, memory_s)) + micro_batches x micro_batch_overhead_s

so the factors can be fitted, and held-back steps predicted, from the components alone, without
tracing again. The efficiencies are searched on a coarse grid, then by Nelder-Mead from its best
points; for each point tried the two overheads are the least-squares solution within their bounds
(`time_model`), the step time being linear in them. The loss is the sum of squared relative errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from anatomist.estimate.time_model import (
    EFFICIENCY_MIN,
    KERNEL_OVERHEAD_MAX_S,
    MICRO_BATCH_OVERHEAD_MAX_S,
    Factors,
    kernel_s,
)

if TYPE_CHECKING:
    from anatomist.estimate.flops import StepOps
    from anatomist.hardware import GPU
    from anatomist.recipe import ResolvedRecipe


@dataclass(frozen=True, slots=True)
class Components:
    """One step reduced to what the model needs: per op record (views left out), seconds at the
    datasheet peaks and calls per optimizer step; and the micro-batches the step runs."""

    tensor_core_s: np.ndarray
    cuda_core_s: np.ndarray
    memory_s: np.ndarray
    calls: np.ndarray
    micro_batches: float
    """Forward-backward passes per optimizer step (gradient accumulation steps)."""

    ARRAYS: ClassVar[tuple[str, ...]] = ("tensor_core_s", "cuda_core_s", "memory_s", "calls")

    def to_dict(self) -> dict[str, Any]:
        """Rounded to 4 significant digits (the stored inputs of benchmarks/published)."""
        return {**{k: [float(f"{v:.4g}") for v in getattr(self, k)] for k in self.ARRAYS},
                "micro_batches": self.micro_batches}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Components:
        return cls(**{k: np.asarray(data[k], dtype=np.float64) for k in cls.ARRAYS},
                   micro_batches=float(data["micro_batches"]))


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
    return Components(tensor_core_s=peaks[:, 0], cuda_core_s=peaks[:, 1], memory_s=peaks[:, 2], calls=calls,
                      micro_batches=float(recipe.gradient_accumulation_steps))


def predict(c: Components, f: Factors) -> float:
    """Predicted seconds of the step `c` with factors `f`."""
    return float(c.calls @ kernel_s(c.tensor_core_s, c.cuda_core_s, c.memory_s, f)) + f.micro_batch_overhead_s * c.micro_batches


def relative_errors(steps: list[Components], measured_s: list[float] | np.ndarray, f: Factors) -> np.ndarray:
    """predicted / measured - 1 per step."""
    return np.array([predict(c, f) for c in steps]) / np.asarray(measured_s, dtype=np.float64) - 1.0


COARSE = np.geomspace(EFFICIENCY_MIN, 1.0, 25)
"""Efficiency grid of the first pass (ratio 1.18 between points)."""
STARTS = 6
"""Grid points the local search starts from (one start can end on a ridge's kink short of the minimum)."""
OVERHEAD_BOUNDS = (KERNEL_OVERHEAD_MAX_S, MICRO_BATCH_OVERHEAD_MAX_S)


@dataclass(frozen=True, slots=True)
class _Flat:
    """Every step's records in one array, for evaluating a point of the search at once."""

    tc: np.ndarray
    cuda: np.ndarray
    mem: np.ndarray
    calls: np.ndarray
    row: np.ndarray
    """The step each record belongs to."""
    kernels: np.ndarray
    """Kernel calls per step."""
    micro_batches: np.ndarray
    n: int


def _flatten(steps: list[Components]) -> _Flat:
    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(c, name) for c in steps])

    return _Flat(tc=cat("tensor_core_s"), cuda=cat("cuda_core_s"), mem=cat("memory_s"), calls=cat("calls"),
                 row=np.concatenate([np.full(len(c.calls), i) for i, c in enumerate(steps)]),
                 kernels=np.array([c.calls.sum() for c in steps]),
                 micro_batches=np.array([c.micro_batches for c in steps]), n=len(steps))


def _bounded_least_squares(a: np.ndarray, b: np.ndarray, upper: tuple[float, float]) -> tuple[float, float]:
    """argmin |a x - b|^2 over 0 <= x_j <= upper_j for two unknowns: the interior solution if it is in
    the box, else the best of the edges (each a one-unknown problem, clipped)."""
    candidates: list[tuple[float, float]] = []
    if np.linalg.matrix_rank(a) == 2:
        x, *_ = np.linalg.lstsq(a, b, rcond=None)
        if 0 <= x[0] <= upper[0] and 0 <= x[1] <= upper[1]:
            candidates.append((float(x[0]), float(x[1])))
    for j in (0, 1):
        col, other = a[:, j], a[:, 1 - j]
        for fixed in (0.0, upper[1 - j]):
            rest = b - other * fixed
            x_j = float(np.clip(col @ rest / (col @ col), 0.0, upper[j])) if col @ col > 0 else 0.0
            candidates.append((x_j, fixed) if j == 0 else (fixed, x_j))
    return min(candidates, key=lambda x: float(np.sum((b - a @ np.array(x)) ** 2)))


def _overheads(rooflines: np.ndarray, flat: _Flat, measured: np.ndarray, fixed_k: float | None,
               fixed_m: float | None) -> tuple[float, float, float]:
    """(error, kernel_overhead_s, micro_batch_overhead_s) minimising
    sum(((roofline + k x kernels + m x micro_batches) / measured - 1)^2) within OVERHEAD_BOUNDS,
    k and m where not given."""
    b = 1.0 - rooflines / measured
    a = np.stack([flat.kernels / measured, flat.micro_batches / measured], axis=1)
    def one_free(j: int, given: float) -> float:
        """Unknown j (0: k, 1: m) by clipped one-unknown least squares, the other `given`."""
        col, rest = a[:, j], b - a[:, 1 - j] * given
        return float(np.clip(col @ rest / (col @ col), 0.0, OVERHEAD_BOUNDS[j])) if col @ col > 0 else 0.0

    if fixed_k is not None and fixed_m is not None:
        k, m = fixed_k, fixed_m
    elif fixed_m is not None:
        k, m = one_free(0, fixed_m), fixed_m
    elif fixed_k is not None:
        k, m = fixed_k, one_free(1, fixed_k)
    else:
        k, m = _bounded_least_squares(a, b, OVERHEAD_BOUNDS)
    r = b - a @ np.array([k, m])
    return float(r @ r), k, m


def fit(steps: list[Components], measured_s: list[float] | np.ndarray, *, base: Factors,
        fixed_overheads: bool = False, fixed_micro_batch_overhead: bool = False) -> tuple[Factors, float]:
    """The factors that best predict `measured_s` (least squared relative error), and that error.

    An efficiency the steps cannot tell (no tensor-core work, or CUDA-core work under 5% of every
    step at the fp32 peak) keeps `base`'s value. With `fixed_overheads`, the two overheads keep `base`'s
    values too (a generation's refit on top of a pooled fit: too few rows to tell them); so they do when
    there are fewer steps than factors to fit (the fit would be one of many that predict them exactly).
    With `fixed_micro_batch_overhead`, only that one keeps `base`'s value (steps that all run about as
    many kernels per micro-batch cannot tell it from the per-kernel overhead).
    """
    if not steps:
        raise ValueError("fit needs at least one measured step")
    measured = np.asarray(measured_s, dtype=np.float64)
    flat = _flatten(steps)
    cuda_share = np.bincount(flat.row, weights=flat.calls * flat.cuda, minlength=flat.n) / measured
    free = (bool(np.any(flat.tc > 0)), bool(np.any(cuda_share > 0.05)), True)  # tensor-core, fp32, bandwidth
    if len(steps) < sum(free) + 2:
        fixed_overheads = True
    fixed_k = base.kernel_overhead_s if fixed_overheads else None
    fixed_m = base.micro_batch_overhead_s if fixed_overheads or fixed_micro_batch_overhead else None

    def evaluate(efficiencies: np.ndarray) -> tuple[float, Factors]:
        e_tc, e_fp32, e_bw = (float(e) for e in efficiencies)
        per_call = np.maximum(flat.tc / e_tc + flat.cuda / e_fp32, flat.mem / e_bw)
        rooflines = np.bincount(flat.row, weights=flat.calls * per_call, minlength=flat.n)
        error, k, m = _overheads(rooflines, flat, measured, fixed_k, fixed_m)
        return error, Factors(tensor_core_efficiency=e_tc, fp32_efficiency=e_fp32, bandwidth_efficiency=e_bw,
                              kernel_overhead_s=k, micro_batch_overhead_s=m)

    origin = np.array([base.tensor_core_efficiency, base.fp32_efficiency, base.bandwidth_efficiency])
    axes = [COARSE if is_free else np.array([value]) for is_free, value in zip(free, origin, strict=True)]
    grid = sorted((evaluate(np.array(point)) for point in np.array(np.meshgrid(*axes, indexing="ij")).reshape(3, -1).T),
                  key=lambda result: result[0])
    indices = [i for i, is_free in enumerate(free) if is_free]

    def polish(start: Factors) -> tuple[float, Factors]:
        """Nelder-Mead on the logarithms of the free efficiencies, clipped to their bounds."""
        logs = np.log([start.tensor_core_efficiency, start.fp32_efficiency, start.bandwidth_efficiency])

        def point(x: np.ndarray) -> np.ndarray:
            full = logs.copy()
            full[indices] = x
            return np.exp(np.clip(full, np.log(EFFICIENCY_MIN), 0.0))

        best = _nelder_mead(lambda x: evaluate(point(x))[0], logs[indices], step=np.log(COARSE[1] / COARSE[0]) / 2)
        return evaluate(point(best))

    error, factors = min((polish(f) for _, f in grid[:STARTS]), key=lambda result: result[0])
    return factors, error


def _nelder_mead(f: Any, x0: np.ndarray, *, step: float, tolerance: float = 1e-10, iterations: int = 2000) -> np.ndarray:
    """Minimise `f` from `x0` by the Nelder-Mead simplex (standard coefficients: reflection 1,
    expansion 2, contraction and shrink 1/2), until the simplex is `tolerance` wide."""
    n = len(x0)
    simplex = np.vstack([x0] + [x0 + step * np.eye(n)[i] for i in range(n)])
    values = np.array([f(x) for x in simplex])
    for _ in range(iterations):
        order = np.argsort(values)
        simplex, values = simplex[order], values[order]
        if np.max(np.abs(simplex[1:] - simplex[0])) < tolerance:
            break
        centroid = simplex[:-1].mean(axis=0)
        reflected = centroid + (centroid - simplex[-1])
        r = f(reflected)
        if r < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            e = f(expanded)
            simplex[-1], values[-1] = (expanded, e) if e < r else (reflected, r)
        elif r < values[-2]:
            simplex[-1], values[-1] = reflected, r
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            c = f(contracted)
            if c < values[-1]:
                simplex[-1], values[-1] = contracted, c
            else:
                simplex[1:] = simplex[0] + 0.5 * (simplex[1:] - simplex[0])
                values[1:] = [f(x) for x in simplex[1:]]
    return np.asarray(simplex[int(np.argmin(values))])
