"""How far a predicted figure may be from what a GPU shows: the errors measured on runs never fitted to, per regime.

Memory. No term of the memory prediction is fitted to GPU runs. It is checked against PyTorch's own accounting of real
CPU steps (the accuracy tests: the allocated peak, within a few percent) and against published GPU runs
(benchmarks/published/memory.toml, checked by `benchmarks/published/memory.py`): what decides whether a run fits,
nvidia-smi's total or the caching allocator's peak reserved, is off there by the errors data/memory_accuracy.toml
keeps per regime (written by `memory.py intervals`, never by hand). The interval of a prediction P is the range of
the truth those errors imply, P / (1 + error), widened to hold P itself: a handful of runs per regime is too few to
say the prediction is off in one direction. A regime without a published run (DeepSpeed ZeRO, plain data
parallelism) takes the range of every published run and is marked not validated, with why.

The verdict: "fits" where the top of the interval is within the limit, "does not fit" where even its bottom is
above it, "borderline" between.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

from anatomist.recipe import Recipe

Verdict = Literal["fits", "borderline", "does not fit"]
VERDICTS: tuple[Verdict, ...] = ("fits", "borderline", "does not fit")

ONE_GPU, ADAPTERS, SHARDED = "one GPU, full fine-tune", "adapters (LoRA, QLoRA)", "sharded (FSDP2, ZeRO)"
MEMORY_REGIMES = (ONE_GPU, ADAPTERS, SHARDED)
"""The regimes published GPU runs are grouped by (benchmarks/published/memory.py)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """The likely range of a predicted figure, and what it rests on."""

    low: float
    high: float
    validated: bool
    """Whether runs of the prediction's own regime measured it (else another regime's runs stand in)."""
    basis: str
    """What the range was measured on, in words."""

    def to_dict(self) -> dict[str, Any]:
        return {"low": self.low, "high": self.high, "validated": self.validated, "basis": self.basis}

    def relative(self, predicted: float) -> tuple[float, float]:
        """The range as fractions of `predicted` (-0.1, +0.15: 10% below to 15% above)."""
        return self.low / predicted - 1, self.high / predicted - 1

    def verdict(self, limit: float) -> Verdict:
        if self.high <= limit:
            return "fits"
        return "does not fit" if self.low > limit else "borderline"


def memory_regime(recipe: Recipe, num_gpus: int) -> tuple[str, str | None]:
    """The published runs' regime `recipe` on `num_gpus` devices belongs to, and why none of them measured it (None
    where they did)."""
    if recipe.zero_stage:
        return SHARDED, "no published GPU run of DeepSpeed ZeRO states its settings"
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
        basis = (f"not validated: {unvalidated}; the range of all {len(errors)} published GPU runs "
                 f"(benchmarks/published/memory_check.txt, {table['measured']})")
    else:
        errors = runs["errors"]
        basis = (f"{len(errors)} published GPU run(s) of {regime} ({', '.join(runs['gpus'])}; "
                 f"benchmarks/published/memory_check.txt, {table['measured']})")
    lowest, highest = min(min(errors), 0.0), max(max(errors), 0.0)
    return Interval(low=predicted_bytes / (1 + highest), high=predicted_bytes / (1 + lowest),
                    validated=unvalidated is None, basis=basis)
