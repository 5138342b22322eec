"""The traces the estimator takes of a step, shared by the memory and the time prediction.

A training step is traced in two parts (forward/backward, optimizer: `trace.step.trace_part`)
on models cut to `TRACE_DEPTHS` blocks; the passes at `TRACE_BATCHES` samples. Everything
the estimator reports is extrapolated from these few traces: every figure of a step is
affine in the number of repeated blocks and, at one depth, in the batch size (each block
and each sample adds the same tensors and the same ops).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np

from anatomist.recipe import Recipe
from anatomist.trace.records import StepTrace
from anatomist.trace.step import Part, trace_part
from anatomist.workload import Workload

Mode = Literal["train", "inference"]

TRACE_DEPTHS = (2, 3)
"""Blocks of the traced models: not 1, where the first block, which reads the embeddings,
would be the only one."""
TRACE_BATCHES = (2, 3)
"""Batch sizes of the traces: not 1, where size-1 dimensions make some copies views, so the
op sequence (and the curve) differs from every larger batch."""


Values = TypeVar("Values", float, np.ndarray)
"""One figure or an array of them (a curve's points)."""


def affine(f_lo: Values, f_hi: Values, x: int, lo: int) -> Values:
    """The value at x of the line through (lo, f_lo) and (lo + 1, f_hi)."""
    return f_lo + (x - lo) * (f_hi - f_lo)


@dataclass(frozen=True, slots=True)
class StepTraces:
    """The traces of one recipe: passes by (depth, batch), optimizer by depth (None in inference)."""

    passes: dict[tuple[int, int], StepTrace]
    optimizer: dict[int, StepTrace] | None


def step_traces(workload: Workload, recipe: Recipe, compute_capability: str, mode: Mode = "train",
                *, use_cache: bool = True) -> StepTraces:
    """The passes at TRACE_DEPTHS x TRACE_BATCHES and, in training, the optimizer at TRACE_DEPTHS."""
    part: Part = "forward-backward" if mode == "train" else "inference"
    passes = {
        (d, b): trace_part(workload, recipe, part, depth=d, batch_size=b, compute_capability=compute_capability,
                           use_cache=use_cache)
        for d in TRACE_DEPTHS for b in TRACE_BATCHES
    }
    optimizer = None
    if mode == "train":
        optimizer = {
            d: trace_part(workload, recipe, "optimizer", depth=d, batch_size=1, compute_capability=compute_capability,
                          use_cache=use_cache)
            for d in TRACE_DEPTHS
        }
    return StepTraces(passes=passes, optimizer=optimizer)
