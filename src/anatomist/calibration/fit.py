"""Fit the time model's factors to measured steps: what `anatomist calibrate` and the published
calibration (benchmarks/published/fit.py) share.

A measured step is reduced to its *components*: for every kernel-launching op record, its
seconds at 100% of the datasheet peaks (tensor cores, CUDA cores, memory), its calls per
optimizer step and its phase; and the micro-batches the step runs. The model (`estimate.time.roofline`) then
predicts

    step_s = sum over phases of max(sum(calls x kernel_s(tc_s, cuda_s, memory_s)), calls x weight x host_op_s)
             + micro_batches x micro_batch_overhead_s

so the factors can be fitted, and held-back steps predicted, from the components alone, without
tracing again. The efficiencies are searched on a coarse grid (the host's time per kernel at the base's
value), then with the host's time by Nelder-Mead from the grid's best points (efficiencies on a log
scale, each clipped to its bounds); for each point tried the per-kernel and per-micro-batch overheads are
the least-squares solution within their bounds (the step time is linear in them once it is known which
phases the host bounds). The loss is the sum of squared relative errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from anatomist.estimate.time.roofline import (
    EFFICIENCY_MIN,
    HOST_OP_MAX_S,
    KERNEL_OVERHEAD_MAX_S,
    MICRO_BATCH_OVERHEAD_MAX_S,
    RECOMPUTE_HOST_WEIGHT,
    Factors,
    host_kernels,
    kernel_s,
    phase_s,
)

if TYPE_CHECKING:
    from anatomist.estimate.time.ops import StepOps
    from anatomist.hardware import GPU
    from anatomist.recipe import ResolvedRecipe


PHASES = 3
"""Phases of a step, as components number them: 0 forward, 1 backward, 2 optimizer (`anatomy.STEP_PHASES`)."""


@dataclass(frozen=True, slots=True)
class Components:
    """One step reduced to what the model needs: per op record (views left out), seconds at the
    datasheet peaks, calls per optimizer step and phase; and the micro-batches the step runs."""

    tensor_core_s: np.ndarray
    cuda_core_s: np.ndarray
    memory_s: np.ndarray
    calls: np.ndarray
    phase: np.ndarray
    """Each record's phase (0 forward, 1 backward, 2 optimizer)."""
    micro_batches: float
    """Forward-backward passes per optimizer step (gradient accumulation steps)."""
    recomputed: float = 0.0
    """Kernel calls per optimizer step of checkpointed layers' forward run again in the backward (`ops.
    recomputed_kernels`); they are among the backward's, and cost the host more (`roofline.host_kernels`)."""
    recompute_weight: float = RECOMPUTE_HOST_WEIGHT
    """Their host time per kernel relative to the forward's (reentrant checkpointing's is lower)."""

    ARRAYS: ClassVar[tuple[str, ...]] = ("tensor_core_s", "cuda_core_s", "memory_s", "calls")

    def to_dict(self) -> dict[str, Any]:
        """Rounded to 4 significant digits (the stored inputs of benchmarks/published)."""
        return {**{k: [float(f"{v:.4g}") for v in getattr(self, k)] for k in self.ARRAYS},
                "phase": [int(v) for v in self.phase], "micro_batches": self.micro_batches, "recomputed": self.recomputed,
                "recompute_weight": self.recompute_weight}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Components:
        return cls(**{k: np.asarray(data[k], dtype=np.float64) for k in cls.ARRAYS},
                   phase=np.asarray(data["phase"], dtype=np.int64), micro_batches=float(data["micro_batches"]),
                   recomputed=float(data.get("recomputed", 0.0)),
                   recompute_weight=float(data.get("recompute_weight", RECOMPUTE_HOST_WEIGHT)))

    def kernels(self) -> np.ndarray:
        """Kernel calls per optimizer step in each phase."""
        return np.bincount(self.phase, weights=self.calls, minlength=PHASES)

    def host_kernels(self) -> np.ndarray:
        """Kernel calls per optimizer step in each phase in forward kernels' worth of host time."""
        return host_kernels(self.kernels(), self.recomputed, self.recompute_weight)


def components(ops: StepOps, recipe: ResolvedRecipe, gpu: GPU, *, optimizer_share: float = 1.0,
               recomputed: float = 0.0, recompute_weight: float = RECOMPUTE_HOST_WEIGHT) -> Components:
    """The components of one optimizer step of `ops` on `gpu`.

    Args:
        optimizer_share: the fraction of the optimizer step this device runs (1/N when ZeRO or
            FSDP shards the optimizer state over N devices).
        recomputed: kernels per micro-batch that checkpointing reruns (`ops.recomputed_kernels`).
        recompute_weight: their host time per kernel, relative to the forward's (`roofline.host_kernels`).
    """
    from anatomist.anatomy import STEP_PHASES, Phase
    from anatomist.estimate.time.device import peak_seconds

    records = [r for r in ops.records if not r.view]
    peaks = np.array([peak_seconds(r, recipe, gpu) for r in records], dtype=np.float64).reshape(-1, 3)
    calls = np.array([r.calls_per_step(recipe.gradient_accumulation_steps)
                      * (optimizer_share if r.phase is Phase.OPTIMIZER else 1.0) for r in records])
    return Components(tensor_core_s=peaks[:, 0], cuda_core_s=peaks[:, 1], memory_s=peaks[:, 2], calls=calls,
                      phase=np.array([STEP_PHASES.index(r.phase) for r in records], dtype=np.int64),
                      micro_batches=float(recipe.gradient_accumulation_steps),
                      recomputed=recomputed * recipe.gradient_accumulation_steps, recompute_weight=recompute_weight)


def predict(c: Components, f: Factors) -> float:
    """Predicted seconds of the step `c` with factors `f`."""
    gpu = np.bincount(c.phase, weights=c.calls * kernel_s(c.tensor_core_s, c.cuda_core_s, c.memory_s, f), minlength=PHASES)
    return float(phase_s(gpu, c.host_kernels(), f).sum()) + f.micro_batch_overhead_s * c.micro_batches


def relative_errors(steps: list[Components], measured_s: list[float] | np.ndarray, f: Factors) -> np.ndarray:
    """predicted / measured - 1 per step."""
    return np.array([predict(c, f) for c in steps]) / np.asarray(measured_s, dtype=np.float64) - 1.0


COARSE = np.geomspace(EFFICIENCY_MIN, 1.0, 25)
"""Efficiency grid of the first pass (ratio 1.18 between points)."""
STARTS = 6
"""Grid points the local search starts from (one start can end on a ridge's kink short of the minimum)."""
HOST_SCAN = np.linspace(0.0, HOST_OP_MAX_S, 13)
"""The host's times per kernel each start is tried at (5 us apart)."""
EFFICIENCIES = ("tensor_core_efficiency", "fp32_efficiency", "bandwidth_efficiency")


@dataclass(frozen=True, slots=True)
class _Flat:
    """Every step's records in one array, for evaluating a point of the search at once."""

    tc: np.ndarray
    cuda: np.ndarray
    mem: np.ndarray
    calls: np.ndarray
    cell: np.ndarray
    """The (step, phase) each record belongs to: step x PHASES + phase."""
    kernels: np.ndarray
    """Kernel calls per (step, phase), [steps, PHASES]."""
    host_kernels: np.ndarray
    """The same in forward kernels' worth of host time (`Components.host_kernels`)."""
    micro_batches: np.ndarray
    n: int


def _flatten(steps: list[Components]) -> _Flat:
    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(c, name) for c in steps])

    return _Flat(tc=cat("tensor_core_s"), cuda=cat("cuda_core_s"), mem=cat("memory_s"), calls=cat("calls"),
                 cell=np.concatenate([i * PHASES + c.phase for i, c in enumerate(steps)]),
                 kernels=np.array([c.kernels() for c in steps]).reshape(-1, PHASES),
                 host_kernels=np.array([c.host_kernels() for c in steps]).reshape(-1, PHASES),
                 micro_batches=np.array([c.micro_batches for c in steps]), n=len(steps))


def _predicted(flat: _Flat, f: Factors) -> np.ndarray:
    """Predicted seconds of every step of `flat` with factors `f` (`predict`, at once)."""
    per_call = kernel_s(flat.tc, flat.cuda, flat.mem, f)
    gpu = np.bincount(flat.cell, weights=flat.calls * per_call, minlength=flat.n * PHASES).reshape(-1, PHASES)
    return phase_s(gpu, flat.host_kernels, f).sum(axis=1) + f.micro_batch_overhead_s * flat.micro_batches


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


def _solve(a: np.ndarray, b: np.ndarray, fixed_k: float | None, fixed_m: float | None,
           upper: tuple[float, float]) -> tuple[float, float]:
    """(k, m) minimising |a (k, m) - b|^2 within 0 <= . <= upper, each at its fixed value where given."""

    def one_free(j: int, given: float) -> float:
        """Unknown j (0: k, 1: m) by clipped one-unknown least squares, the other `given`."""
        col, rest = a[:, j], b - a[:, 1 - j] * given
        return float(np.clip(col @ rest / (col @ col), 0.0, upper[j])) if col @ col > 0 else 0.0

    if fixed_k is not None and fixed_m is not None:
        return fixed_k, fixed_m
    if fixed_m is not None:
        return one_free(0, fixed_m), fixed_m
    if fixed_k is not None:
        return fixed_k, one_free(1, fixed_k)
    return _bounded_least_squares(a, b, upper)


def _overheads(rooflines: np.ndarray, host: np.ndarray, flat: _Flat, measured: np.ndarray, fixed_k: float | None,
               fixed_m: float | None) -> tuple[float, float, float]:
    """(error, kernel_overhead_s, micro_batch_overhead_s) minimising the squared relative error of
    sum over phases of max(roofline + k x kernels, host) + m x micro_batches, k and m where not given, each within
    its bounds. The step time is linear in k and m once it is known which phases the GPU bounds: start with every
    phase GPU-bound, solve, and solve again with the phases the host bounds at that k until they stay the same."""
    upper = (KERNEL_OVERHEAD_MAX_S, MICRO_BATCH_OVERHEAD_MAX_S)
    k = fixed_k if fixed_k is not None else 0.0
    gpu_bound = np.ones_like(rooflines, dtype=bool)
    for _ in range(8):
        constant = np.where(gpu_bound, rooflines, host).sum(axis=1)
        b = 1.0 - constant / measured
        a = np.stack([np.where(gpu_bound, flat.kernels, 0.0).sum(axis=1) / measured, flat.micro_batches / measured],
                     axis=1)
        k, m = _solve(a, b, fixed_k, fixed_m, upper)
        bound = rooflines + k * flat.kernels >= host
        if np.array_equal(bound, gpu_bound):
            break
        gpu_bound = bound
    r = (np.maximum(rooflines + k * flat.kernels, host).sum(axis=1) + m * flat.micro_batches) / measured - 1.0
    return float(r @ r), k, m


def fit(steps: list[Components], measured_s: list[float] | np.ndarray, *, base: Factors,
        fixed_overheads: bool = False, fixed_micro_batch_overhead: bool = False,
        fixed_bandwidth: bool = False) -> tuple[Factors, float]:
    """The factors that best predict `measured_s` (least squared relative error), and that error.

    An efficiency the steps cannot tell (no tensor-core work, or CUDA-core work under 5% of every
    step at the fp32 peak) keeps `base`'s value. With `fixed_overheads`, the three overheads keep `base`'s
    values too (a generation's refit on top of a pooled fit: too few rows to tell them); so they do when
    there are fewer steps than factors to fit (the fit would be one of many that predict them exactly).
    With `fixed_micro_batch_overhead`, only that one keeps `base`'s value (steps that all run about as
    many kernels per micro-batch cannot tell it from the per-kernel overhead). With `fixed_bandwidth`, the
    bandwidth efficiency keeps `base`'s value (a generation's refit: its few runs trade it against the tensor-core
    efficiency).

    The efficiencies and the host's time per kernel are searched (a grid over the efficiencies, then Nelder-Mead
    over all of them); for each point tried the two other overheads are the least-squares solution (`_overheads`).
    """
    if not steps:
        raise ValueError("fit needs at least one measured step")
    measured = np.asarray(measured_s, dtype=np.float64)
    flat = _flatten(steps)
    cuda_share = np.bincount(flat.cell // PHASES, weights=flat.calls * flat.cuda, minlength=flat.n) / measured
    free = [name for name, is_free in zip(
        EFFICIENCIES, (bool(np.any(flat.tc > 0)), bool(np.any(cuda_share > 0.05)), not fixed_bandwidth), strict=True)
        if is_free]
    if len(steps) < len(free) + 3 - fixed_micro_batch_overhead:
        fixed_overheads = True
    if not fixed_overheads:
        free.append("host_op_s")
    fixed_k = base.kernel_overhead_s if fixed_overheads else None
    fixed_m = base.micro_batch_overhead_s if fixed_overheads or fixed_micro_batch_overhead else None

    def evaluate(x: np.ndarray) -> tuple[float, Factors]:
        """The error and factors at search point `x` (log efficiencies, the host's time in us; each clipped)."""
        values = {name: float(np.exp(np.clip(v, np.log(EFFICIENCY_MIN), 0.0))) if name in EFFICIENCIES
                  else float(np.clip(v * 1e-6, 0.0, HOST_OP_MAX_S)) for name, v in zip(free, x, strict=True)}
        f = base.replace(**values, kernel_overhead_s=0.0)
        per_call = kernel_s(flat.tc, flat.cuda, flat.mem, f)
        rooflines = np.bincount(flat.cell, weights=flat.calls * per_call, minlength=flat.n * PHASES).reshape(-1, PHASES)
        host = flat.host_kernels * f.host_op_s
        error, k, m = _overheads(rooflines, host, flat, measured, fixed_k, fixed_m)
        return error, f.replace(kernel_overhead_s=k, micro_batch_overhead_s=m)

    def point(f: Factors) -> np.ndarray:
        return np.array([np.log(getattr(f, n)) if n in EFFICIENCIES else getattr(f, n) * 1e6 for n in free])

    axes = [COARSE if n in free else np.array([getattr(base, n)]) for n in EFFICIENCIES]
    grid = [base.replace(**dict(zip(EFFICIENCIES, (float(v) for v in p), strict=True)))
            for p in np.array(np.meshgrid(*axes, indexing="ij")).reshape(3, -1).T]
    starts = sorted(grid, key=lambda f: evaluate(point(f))[0])[:STARTS]
    if "host_op_s" in free:  # each start at the best of a scan of the host's time (the grid kept the base's)
        starts = [min((f.replace(host_op_s=float(h)) for h in HOST_SCAN), key=lambda g: evaluate(point(g))[0])
                  for f in starts]
    steps_of = np.array([np.log(COARSE[1] / COARSE[0]) / 2 if n in EFFICIENCIES else HOST_OP_MAX_S * 1e6 / 8 for n in free])
    best = min((_nelder_mead(lambda x: evaluate(x)[0], point(f), step=steps_of) for f in starts),
               key=lambda x: evaluate(x)[0])
    error, factors = evaluate(best)
    return factors, error


def _nelder_mead(f: Any, x0: np.ndarray, *, step: np.ndarray, tolerance: float = 1e-10,
                 iterations: int = 4000) -> np.ndarray:
    """Minimise `f` from `x0` by the Nelder-Mead simplex (standard coefficients: reflection 1,
    expansion 2, contraction and shrink 1/2; initial edges `step` along each axis), until the simplex
    is `tolerance` wide."""
    n = len(x0)
    if n == 0:
        return x0
    simplex = np.vstack([x0] + [x0 + step[i] * np.eye(n)[i] for i in range(n)])
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
