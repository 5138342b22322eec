"""Fit and cross-validate the time model on published runs (benchmarks/published): the two-stage
fit per generation and the leave-one-source-out error that the shipped calibration claims.

Stage 1 fits four of the five factors (`time_model.Factors`) on every run given (pooled): the host
time per micro-batch is the measured one (`time_model.MICRO_BATCH_OVERHEAD_S`), since every source
launches about as many kernels per micro-batch and the runs cannot tell it from the per-kernel
overhead. Stage 2 refits the three efficiencies on one generation's runs with the pooled overheads
kept (a generation has too few runs, all of large steps, to tell the overheads).

Cross-validation, per generation: each of its sources is predicted by the two stages fitted on
every run of every other source (of all generations); a generation with a single source is then
predicted by the pooled fit of the other generations alone. For "any" (a GPU in no generation),
each generation is predicted by the pooled fit of the others (leave-one-generation-out).
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anatomist.estimate.calibration import ANY_GENERATION, generation_of_gpu
from anatomist.estimate.time_fit import Components, fit, relative_errors
from anatomist.estimate.time_model import MICRO_BATCH_OVERHEAD_S, Factors

PRIOR = Factors(tensor_core_efficiency=0.6, fp32_efficiency=0.8, bandwidth_efficiency=0.7,
                kernel_overhead_s=5e-6, micro_batch_overhead_s=MICRO_BATCH_OVERHEAD_S)
"""Where the grid search starts and what a factor the runs cannot tell keeps (time model 1's
placeholders: 0.6 between cuBLAS GEMM peaks and end-to-end MFU, 0.8 SGEMM, 0.7 streaming kernels;
the host time per micro-batch measured on the build machine)."""


@dataclass(frozen=True, slots=True)
class Run:
    """One published run reduced to what the fit needs."""

    key: str
    source: str
    gpu: str
    measured_s: float
    components: Components

    @property
    def generation(self) -> str:
        return generation_of_gpu(self.gpu)


@dataclass(frozen=True, slots=True)
class CrossValidated:
    median_error_pct: float
    worst_error_pct: float
    runs: int
    sources: int
    method: str
    errors: dict[str, float]
    """Held-out relative error (predicted / measured - 1) per run key."""


def measured_step_s(run: dict[str, Any]) -> float:
    """Seconds per optimizer step on one GPU, from the throughput a published run states:
    micro-batch x accumulation x seq_len / tokens per second per GPU, or samples / samples per second."""
    samples = run["per_device_train_batch_size"] * run["gradient_accumulation_steps"]
    if "tokens_per_second_per_gpu" in run:
        return float(samples * run["seq_len"] / run["tokens_per_second_per_gpu"])
    return float(samples / run["samples_per_second"])


def run_key(run: dict[str, Any]) -> str:
    """A run's key in components.json: its source and a digest of the whole row (one quoted table line
    can give several runs: NVIDIA's tables give fp32 and mixed precision on one line)."""
    return f"{run['source']}/{hashlib.sha1(json.dumps(run, sort_keys=True).encode()).hexdigest()[:10]}"


def load_runs(path: Path) -> list[dict[str, Any]]:
    """The runs of a runs.toml, each with its source's code settings (`attn_implementation`: the attention
    its code runs) unless it gives its own."""
    raw = tomllib.loads(path.read_text())
    sources = {s["id"]: s for s in raw.get("sources", [])}
    return [{"attn_implementation": sources[r["source"]]["attn_implementation"], **r} if r["source"] in sources else r
            for r in raw["runs"]]


def load_inputs(runs: list[dict[str, Any]], stored: dict[str, Any]) -> list[Run]:
    """The runs of runs.toml with their stored components (components.json, keyed by `run_key`).

    Raises:
        ValueError: a run has no stored components, or they were computed for another quote
            (runs.toml changed since `fit.py components`).
    """
    out = []
    for run in runs:
        key = run_key(run)
        entry = stored.get(key)
        if entry is None:
            raise ValueError(f"{key}: no stored components for this run (runs.toml changed?); run `fit.py components`")
        out.append(Run(key=key, source=run["source"], gpu=run["gpu"], measured_s=measured_step_s(run),
                       components=Components.from_dict(entry["components"])))
    return out


def _fit(runs: list[Run], *, base: Factors = PRIOR, fixed_overheads: bool = False) -> Factors:
    """The fit of `runs`, the host time per micro-batch kept at `base`'s (see `time_model.MICRO_BATCH_OVERHEAD_S`)."""
    return fit([r.components for r in runs], [r.measured_s for r in runs], base=base, fixed_overheads=fixed_overheads,
               fixed_micro_batch_overhead=True)[0]


def fit_generation(train: list[Run], generation: str) -> Factors:
    """Stage 1 on `train`, then stage 2 on `train`'s runs of `generation` (if any)."""
    pooled = _fit(train)
    own = [r for r in train if r.generation == generation]
    return _fit(own, base=pooled, fixed_overheads=True) if own and generation != ANY_GENERATION else pooled


def fit_all(runs: list[Run]) -> dict[str, Factors]:
    """The shipped factors: one per generation with runs, and "any" (the pooled fit)."""
    pooled = _fit(runs)
    out = {}
    for generation in dict.fromkeys(r.generation for r in runs):
        own = [r for r in runs if r.generation == generation]
        out[generation] = _fit(own, base=pooled, fixed_overheads=True)
    out[ANY_GENERATION] = pooled
    return out


def _summary(errors: dict[str, float], sources: int, method: str) -> CrossValidated:
    values = np.abs(np.array(list(errors.values())))
    return CrossValidated(median_error_pct=float(np.median(values) * 100), worst_error_pct=float(values.max() * 100),
                          runs=len(values), sources=sources, method=method, errors=errors)


def cross_validate(runs: list[Run]) -> dict[str, CrossValidated]:
    """Held-out errors per generation, and for "any" (module docstring)."""
    out = {}
    for generation in dict.fromkeys(r.generation for r in runs):
        own = [r for r in runs if r.generation == generation]
        sources = list(dict.fromkeys(r.source for r in own))
        errors: dict[str, float] = {}
        for source in sources:
            held = [r for r in own if r.source == source]
            factors = fit_generation([r for r in runs if r.source != source], generation)
            errors |= dict(zip([r.key for r in held], relative_errors(
                [r.components for r in held], [r.measured_s for r in held], factors).tolist(), strict=True))
        out[generation] = _summary(errors, len(sources), "leave-one-source-out")
    errors = {}
    for generation in dict.fromkeys(r.generation for r in runs):
        held = [r for r in runs if r.generation == generation]
        pooled = _fit([r for r in runs if r.generation != generation])
        errors |= dict(zip([r.key for r in held], relative_errors(
            [r.components for r in held], [r.measured_s for r in held], pooled).tolist(), strict=True))
    out[ANY_GENERATION] = _summary(errors, len({r.source for r in runs}), "leave-one-generation-out")
    return out
