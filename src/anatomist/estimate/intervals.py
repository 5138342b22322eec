"""How far a predicted figure may be from what a GPU shows: the errors measured on runs never fitted to, per regime.

Memory. No term of the memory prediction is fitted to GPU runs. It is checked against PyTorch's own accounting of real
CPU steps (the accuracy tests: the allocated peak, within a few percent) and against published GPU runs
(benchmarks/published/memory.toml, checked by `benchmarks/published/memory.py`) and our own Trainer steps on lent GPUs
(benchmarks/gpu/<device>/bench.jsonl, the same script): what decides whether a run fits,
nvidia-smi's total or the caching allocator's peak reserved, is off there by the errors data/memory_accuracy.toml
keeps per regime (written by `memory.py intervals`, never by hand). The interval of a prediction P is the range of
the truth those errors imply, P / (1 + error), widened to hold P itself: a handful of runs per regime is too few to
say the prediction is off in one direction. A regime without a published run (DeepSpeed ZeRO, plain data
parallelism) takes the range of every published run and is marked not validated, with why.

The verdict: "fits" where the top of the interval is within the limit, "does not fit" where even its bottom is
above it, "borderline" between.

Time. The time model's factors are fitted to published training runs (benchmarks/published/fit.py); its error is
what runs the fit never saw show: each source of runs predicted by a fit without it (leave-one-source-out), per
regime, kept in data/time_accuracy.toml (written by `fit.py fit`, never by hand). The interval of a predicted step
time P is P / (1 + e) over the 10th to 90th percentile of the held-out errors e of the GPU generation whose
calibration P used, widened to hold P: eight in ten held-out runs of that generation were inside it. A recipe that no
published timed run exercises (adapters, DeepSpeed ZeRO, offload, several nodes, ...) keeps that range and is marked
not validated, with why; so is a GPU in no generation (the range of each generation predicted by a fit of the others)
and a user's measured calibration (its fit error is in-sample: no run it did not fit checked it).
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from anatomist.anatomy import Interval
from anatomist.calibration.lookup import ANY_GENERATION, Calibration
from anatomist.recipe import Recipe

ONE_GPU, ADAPTERS, SHARDED = "one GPU, full fine-tune", "adapters (LoRA, QLoRA)", "sharded (FSDP2, ZeRO)"
MEMORY_REGIMES = (ONE_GPU, ADAPTERS, SHARDED)
"""The regimes published GPU runs are grouped by (benchmarks/published/memory.py)."""


def memory_regime(recipe: Recipe, num_gpus: int) -> tuple[str, str | None]:
    """The published runs' regime `recipe` on `num_gpus` devices belongs to, and why none of them measured it (None
    where they did)."""
    if recipe.zero_stage:
        return SHARDED, "no published GPU run of DeepSpeed ZeRO states its settings"
    if recipe.tp_size > 1:
        return SHARDED, "no published GPU run of tensor parallel states its memory"
    if recipe.cp_size > 1:
        return SHARDED, "no published GPU run of context parallel states its memory"
    if recipe.fsdp != "none":
        return SHARDED, None
    regime = ADAPTERS if recipe.peft != "none" else ONE_GPU
    if num_gpus > 1:
        return regime, "no published GPU run of plain data parallelism states its memory"
    return regime, None


@cache
def memory_accuracy() -> dict[str, Any]:
    """data/memory_accuracy.toml: the errors of each regime's published runs, and when they were measured."""
    return tomllib.loads(resources.files("anatomist.data").joinpath("memory_accuracy.toml").read_text())


def memory_interval(predicted_bytes: int, recipe: Recipe, num_gpus: int) -> Interval:
    """The likely range of the device total `predicted_bytes` of `recipe` on `num_gpus` devices (module docstring)."""
    table = memory_accuracy()
    regime, unvalidated = memory_regime(recipe, num_gpus)
    runs = table["regimes"].get(regime)
    if runs is None and unvalidated is None:
        unvalidated = f"no published GPU run of the regime {regime!r}"
    if unvalidated is not None:
        errors = [e for r in table["regimes"].values() for e in r["errors"]]
        basis = (f"not validated: {unvalidated}; the range of all {len(errors)} GPU runs "
                 f"(benchmarks/published/memory_check.txt, benchmarks/gpu; {table['measured']})")
    else:
        errors = runs["errors"]
        lent = sum(row.startswith("lent-") for row in runs["rows"])
        runs_text = f"{len(errors) - lent} published GPU run(s)" + (f" and {lent} of our own" if lent else "")
        basis = (f"{runs_text} of {regime} ({', '.join(runs['gpus'])}; benchmarks/published/memory_check.txt, "
                 f"benchmarks/gpu; {table['measured']})")
    lowest, highest = min(min(errors), 0.0), max(max(errors), 0.0)
    return Interval(low=predicted_bytes / (1 + highest), high=predicted_bytes / (1 + lowest),
                    validated=unvalidated is None, basis=basis)


TIME_PERCENTILES = (10, 90)
"""The share of held-out errors a time interval spans: from the 10th to the 90th percentile (eight runs in ten)."""

TIME_UNVALIDATED: tuple[tuple[str, Callable[[Recipe, int, int], bool]], ...] = (
    ("no published timed run trains adapters (LoRA, QLoRA)", lambda r, gpus, nodes: r.peft != "none"),
    ("no published timed run of DeepSpeed ZeRO", lambda r, gpus, nodes: r.zero_stage > 0),
    ("no published timed run of tensor parallel", lambda r, gpus, nodes: r.tp_size > 1),
    ("no published timed run of context parallel", lambda r, gpus, nodes: r.cp_size > 1),
    ("no published timed run of sequence parallel", lambda r, gpus, nodes: r.sp_size > 1),
    ("no published timed run of plain data parallelism",
     lambda r, gpus, nodes: gpus > 1 and r.zero_stage == 0 and r.fsdp == "none" and r.tp_size == 1),
    ("the published timed runs are on one node (the multi-node check, docs/time.md, is not in this interval)",
     lambda r, gpus, nodes: nodes > 1),
    ("no published timed run offloads to the CPU",
     lambda r, gpus, nodes: r.offload != "none" or r.checkpoint_offload or r.activation_offloading),
    ("no published timed run of torch.compile", lambda r, gpus, nodes: r.torch_compile),
    ("no published timed run with Liger Kernel or Cut Cross-Entropy",
     lambda r, gpus, nodes: r.use_liger_kernel or r.cut_cross_entropy),
    ("no published timed run of a DPO step", lambda r, gpus, nodes: r.trainer == "dpo"),
)
"""What no run of data/time_accuracy.toml exercised, each with the test of a recipe on `gpus` devices in `nodes`
machines: a prediction of such a recipe keeps its generation's range, marked not validated."""


@cache
def time_accuracy() -> dict[str, Any]:
    """data/time_accuracy.toml: the held-out errors of the published time calibration per regime, and when they
    were measured."""
    return tomllib.loads(resources.files("anatomist.data").joinpath("time_accuracy.toml").read_text())


def time_unvalidated(recipe: Recipe, num_gpus: int, nodes: int) -> list[str]:
    """Why no published timed run measured a step like `recipe`'s on `num_gpus` devices in `nodes` machines
    (TIME_UNVALIDATED; empty where they did)."""
    return [why for why, applies in TIME_UNVALIDATED if applies(recipe, num_gpus, nodes)]


@dataclass(frozen=True, slots=True)
class TimeErrors:
    """The errors (predicted / measured - 1) a time interval rests on, summarised."""

    low: float
    """The TIME_PERCENTILES[0] percentile of the signed errors (a prediction this far under the truth, or further,
    is one in ten)."""
    high: float
    """The TIME_PERCENTILES[1] percentile."""
    median_abs: float
    """The median |error|."""
    basis: str
    """What they were measured on, in words."""
    unvalidated: str | None
    """Why they do not validate the prediction (None where they do)."""


def time_errors(calibration: Calibration) -> TimeErrors:
    """The errors a step time predicted with `calibration` is known to have (module docstring): its GPU generation's
    held-out errors; "any"'s (leave-one-generation-out) for a GPU in no generation; a measured calibration's
    in-sample worst error, taken both ways."""
    table = time_accuracy()
    if calibration.kind == "measured" and calibration.error is not None:
        e = calibration.error
        worst = min(e.worst_error_pct / 100, 0.9)
        return TimeErrors(low=-worst, high=worst, median_abs=e.median_error_pct / 100,
                          basis=f"the worst error of its own fit ({e.runs} rows), either way",
                          unvalidated=f"{calibration.source}: fitted to the rows it is checked on (in-sample)")
    generation = calibration.generation if calibration.kind == "published" else None
    regime = table["regimes"].get(f"generation: {generation}")
    unvalidated = None
    if generation == ANY_GENERATION or regime is None:
        regime = table["regimes"][f"generation: {ANY_GENERATION}"]
        unvalidated = {"measured": f"{calibration.source} records no fit error",
                       "placeholder": "uncalibrated factors"}.get(
            calibration.kind, "the GPU is in no generation of the published runs (each generation predicted by a fit "
                              "of the others)")
    errors = np.array(regime["errors"])
    where = f"GPU generation {generation}" if unvalidated is None else "every generation"
    basis = (f"{TIME_PERCENTILES[0]}th to {TIME_PERCENTILES[1]}th percentile of {len(errors)} published runs held out "
             f"of the fit ({regime['method']}, {regime['sources']} sources, {where}; {table['measured']})")
    low, high = (float(np.percentile(errors, q)) for q in TIME_PERCENTILES)
    return TimeErrors(low=low, high=high, median_abs=float(np.median(np.abs(errors))), basis=basis,
                      unvalidated=unvalidated)


def time_interval(step_s: float, calibration: Calibration, recipe: Recipe, num_gpus: int = 1,
                  nodes: int = 1) -> Interval:
    """The likely range of the step time `step_s` predicted with `calibration` for `recipe` on `num_gpus` devices in
    `nodes` machines (module docstring): P / (1 + e) between the TIME_PERCENTILES of the held-out errors e of the
    calibration's GPU generation (`time_errors`), widened to hold P.

    Not validated, with why: a GPU in no generation, a measured calibration (`time_errors`), a recipe of
    TIME_UNVALIDATED (its generation's range kept).
    """
    errors = time_errors(calibration)
    reasons = ([errors.unvalidated] if errors.unvalidated else []) + time_unvalidated(recipe, num_gpus, nodes)
    basis = f"not validated: {'; '.join(reasons)}; {errors.basis}" if reasons else errors.basis
    return Interval(low=step_s / (1 + max(errors.high, 0.0)), high=step_s / (1 + min(errors.low, 0.0)),
                    validated=not reasons, basis=basis)
