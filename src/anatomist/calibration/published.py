"""Fit and cross-validate the time model on published runs (benchmarks/published): the two-stage
fit per generation and the leave-one-source-out error that the shipped calibration claims.

Stage 1 fits five of the six factors (`roofline.Factors`) on every run given (pooled): the host
time per micro-batch is the measured one (`roofline.MICRO_BATCH_OVERHEAD_S`), since every source
launches about as many kernels per micro-batch and the runs cannot tell it from the per-kernel
overhead. Stage 2 refits the tensor-core and fp32 efficiencies on one generation's runs with the pooled
bandwidth efficiency and overheads kept (a generation has too few runs, all of large steps, to tell the
overheads, and its few runs trade the bandwidth efficiency against the tensor-core one).

Cross-validation, per generation: each of its sources is predicted by the two stages fitted on
every run of every other source (of all generations); a generation with a single source is then
predicted by the pooled fit of the other generations alone. For "any" (a GPU in no generation),
each generation is predicted by the pooled fit of the others (leave-one-generation-out).

The same held-out errors are then grouped by regime (`REGIME_DIMENSIONS`: precision, devices, code), and
the checks (checks.toml: runs no fit ever sees) join them, predicted by the fit of every run: what
`time_interval` reads to give a prediction its error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anatomist.calibration.fit import Components, fit, relative_errors
from anatomist.calibration.lookup import ANY_GENERATION, generation_of_gpu
from anatomist.estimate.time.roofline import (
    FACTOR_FIELDS,
    HOST_OP_S,
    MICRO_BATCH_OVERHEAD_S,
    TIME_MODEL_VERSION,
    Factors,
)

PRIOR = Factors(tensor_core_efficiency=0.6, fp32_efficiency=0.8, bandwidth_efficiency=0.7,
                kernel_overhead_s=5e-6, micro_batch_overhead_s=MICRO_BATCH_OVERHEAD_S, host_op_s=HOST_OP_S)
"""Where the grid search starts and what a factor the runs cannot tell keeps (time model 1's
placeholders: 0.6 between cuBLAS GEMM peaks and end-to-end MFU, 0.8 SGEMM, 0.7 streaming kernels;
the host times per micro-batch and per op measured on the build machine)."""


@dataclass(frozen=True, slots=True)
class Run:
    """One published run reduced to what the fit needs."""

    key: str
    source: str
    gpu: str
    measured_s: float
    components: Components
    regimes: dict[str, str] = dataclasses.field(default_factory=dict)
    """The run's regime in each of `REGIME_DIMENSIONS` (`run_regimes`)."""

    @property
    def generation(self) -> str:
        return generation_of_gpu(self.gpu)


REGIME_DIMENSIONS = ("precision", "devices", "code")
"""What a prediction's error is known per, besides the GPU generation: the precision of its matrix products
(fp32/tf32, mixed: fp16/bf16 autocast over fp32 weights, half: half-precision weights), one GPU or sharded over
several, and whether the code is a fused stack (NVIDIA's BERT, llm-foundry) or Transformers' eager code (the
Trainer and the loops of its pull requests' benchmarks: what anatomist predicts)."""

PRECISION_REGIMES = {"fp32": "fp32/tf32", "tf32": "fp32/tf32", "fp16": "mixed", "bf16": "mixed",
                     "bf16-weights": "half", "fp16-weights": "half"}
EAGER_STEPS = ("sdpa-benchmark", "trainer-2022")
"""Steps (loops.py) that run Transformers' eager code; the other published runs are fused stacks."""


def run_regimes(run: dict[str, Any]) -> dict[str, str]:
    """The regime of a published run (a row of runs.toml or checks.toml) in each of `REGIME_DIMENSIONS`."""
    return {"precision": PRECISION_REGIMES[run["precision"]],
            "devices": "sharded" if run.get("sharding", "none") != "none" and run["num_gpus"] > 1 else "one GPU",
            "code": "eager" if run.get("step", "trainer") in EAGER_STEPS else "fused"}


@dataclass(frozen=True, slots=True)
class CrossValidated:
    median_error_pct: float
    worst_error_pct: float
    runs: int
    sources: int
    method: str
    errors: dict[str, float]
    """Held-out relative error (predicted / measured - 1) per run key."""

    @property
    def low_pct(self) -> float:
        """The 10th percentile of the signed held-out errors, in percent (a prediction this much below the truth
        or more is one in ten)."""
        return float(np.percentile(list(self.errors.values()), 10) * 100)

    @property
    def high_pct(self) -> float:
        """The 90th percentile of the signed held-out errors, in percent."""
        return float(np.percentile(list(self.errors.values()), 90) * 100)


def measured_step_s(run: dict[str, Any]) -> float:
    """Seconds per optimizer step on one GPU, from what a published run states: its seconds per step, or
    micro-batch x accumulation x seq_len / tokens per second per GPU, or samples / samples per second."""
    if "seconds_per_step" in run:
        return float(run["seconds_per_step"])
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
                       components=Components.from_dict(entry["components"]), regimes=run_regimes(run)))
    return out


def _fit(runs: list[Run], *, base: Factors = PRIOR, generation: bool = False) -> Factors:
    """The fit of `runs`, the host time per micro-batch kept at `base`'s (see `roofline.MICRO_BATCH_OVERHEAD_S`); a
    `generation`'s (stage 2) keeps every factor of `base` but the matrix products' efficiencies."""
    return fit([r.components for r in runs], [r.measured_s for r in runs], base=base, fixed_overheads=generation,
               fixed_bandwidth=generation, fixed_micro_batch_overhead=True)[0]


def fit_generation(train: list[Run], generation: str) -> Factors:
    """Stage 1 on `train`, then stage 2 on `train`'s runs of `generation` (if any)."""
    pooled = _fit(train)
    own = [r for r in train if r.generation == generation]
    return _fit(own, base=pooled, generation=True) if own and generation != ANY_GENERATION else pooled


def fit_all(runs: list[Run]) -> dict[str, Factors]:
    """The shipped factors: one per generation with runs, and "any" (the pooled fit)."""
    pooled = _fit(runs)
    out = {}
    for generation in dict.fromkeys(r.generation for r in runs):
        own = [r for r in runs if r.generation == generation]
        out[generation] = _fit(own, base=pooled, generation=True)
    out[ANY_GENERATION] = pooled
    return out


def _summary(errors: dict[str, float], sources: int, method: str) -> CrossValidated:
    values = np.abs(np.array(list(errors.values())))
    return CrossValidated(median_error_pct=float(np.median(values) * 100), worst_error_pct=float(values.max() * 100),
                          runs=len(values), sources=sources, method=method, errors=errors)


def cross_validate(runs: list[Run], checks: Sequence[Run] = ()) -> dict[str, CrossValidated]:
    """Held-out errors per generation, for "any", and per regime "dimension: value" (module docstring); the
    `checks` (never fitted) are predicted by the fit of every run and join their generation's and regimes'."""
    out: dict[str, CrossValidated] = {}
    held_out: dict[str, float] = {}
    for generation in dict.fromkeys(r.generation for r in runs):
        own = [r for r in runs if r.generation == generation]
        sources = list(dict.fromkeys(r.source for r in own))
        errors: dict[str, float] = {}
        for source in sources:
            held = [r for r in own if r.source == source]
            errors |= _errors(held, fit_generation([r for r in runs if r.source != source], generation))
        out[generation] = _summary(errors, len(sources), "leave-one-source-out")
        held_out |= errors
    errors = {}
    for generation in dict.fromkeys(r.generation for r in runs):
        held = [r for r in runs if r.generation == generation]
        errors |= _errors(held, _fit([r for r in runs if r.generation != generation]))
    out[ANY_GENERATION] = _summary(errors, len({r.source for r in runs}), "leave-one-generation-out")
    for generation in dict.fromkeys(r.generation for r in checks):
        held_out |= _errors([r for r in checks if r.generation == generation], fit_generation(runs, generation))
    everything = {r.key: r for r in (*runs, *checks)}
    checked = {r.key for r in checks}
    for dimension in REGIME_DIMENSIONS:
        for value in dict.fromkeys(r.regimes[dimension] for r in everything.values()):
            keys = [k for k, r in everything.items() if r.regimes[dimension] == value]
            out[f"{dimension}: {value}"] = _summary(
                {k: held_out[k] for k in keys}, len({everything[k].source for k in keys}),
                "leave-one-source-out" + (", and checks never fitted" if checked & set(keys) else ""))
    return out


def _errors(held: list[Run], factors: Factors) -> dict[str, float]:
    """predicted / measured - 1 of each of `held`, with `factors`."""
    return dict(zip([r.key for r in held], relative_errors([r.components for r in held], [r.measured_s for r in held],
                                                           factors).tolist(), strict=True))


def published_toml(fitted: dict[str, Factors], cv: dict[str, Any]) -> str:
    """data/time_calibration.toml from fit.py's factors per generation and cross-validation
    (`published.CrossValidated` per generation; its signed errors per regime go to data/time_accuracy.toml)."""
    lines = [
        "# The time model's factors per GPU generation, fitted to published training runs by",
        "# benchmarks/published/fit.py (the runs and their sources: benchmarks/published/runs.toml).",
        "# Generated: edit the runs or the model, then run `fit.py components` and `fit.py fit`.",
        "# cross_validation: leave-one-source-out (each source predicted by a fit without it); for",
        "# 'any' (GPUs in no generation) leave-one-generation-out. Errors are |predicted/measured - 1|;",
        "# the signed errors themselves, per generation and per regime: data/time_accuracy.toml.",
        f"time_model_version = {TIME_MODEL_VERSION}",
    ]

    for name, f in fitted.items():
        c = cv[name]
        lines += ["", f"[generations.{name}]", *(f"{n} = {getattr(f, n):.4g}" for n in FACTOR_FIELDS),
                  "", f"[generations.{name}.cross_validation]", f"median_error_pct = {c.median_error_pct:.1f}",
                  f"worst_error_pct = {c.worst_error_pct:.1f}", f"runs = {c.runs}", f"sources = {c.sources}",
                  f"method = {json.dumps(c.method)}"]
    return "\n".join(lines) + "\n"
