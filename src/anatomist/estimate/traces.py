"""The traces the estimator takes of a step, shared by the memory and the time prediction.

A training step is traced in two parts (forward/backward, optimizer: `trace.store.parts.trace_part`)
on the cuts of the model its plan names (`trace.depth.plan`: the model cut to 2 and 3 blocks for a
stack of blocks all alike, one block of each kind for stacks of several, or the full model); the
passes at `TRACE_BATCHES` samples. Everything the estimator reports is extrapolated from these
few traces: every figure of a step is affine in the number of blocks of each kind and, for one
cut, in the batch size (each block and each sample adds the same tensors and the same ops).

Never silently wrong: after every plan, the parameter count the traces imply must equal the exact
count of the full model built on the meta device. Where it does not, the model is traced at full
depth; where even that disagrees, the notes say so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np

from anatomist.errors import InputError
from anatomist.estimate.sharding import as_deepspeed_runs
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.depth.cuts import Depth
from anatomist.trace.depth.plan import TRACE_DEPTHS, ModelSize, TracePlan, full_plan, model_plan
from anatomist.trace.engine.records import StepTrace
from anatomist.trace.step.experts import check_traceable
from anatomist.trace.store.keys import Part
from anatomist.trace.store.parts import PartRequest, trace_part, trace_parts
from anatomist.workload import Workload

__all__ = ["TRACE_BATCHES", "TRACE_DEPTHS", "Mode", "StepTraces", "affine", "implied_parameters", "offloaded_bytes",
           "parts_of", "prefetch", "step_traces"]

Mode = Literal["train", "inference"]

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
    """The traces of one recipe: passes by (cut, batch), optimizer by cut (None in inference)."""

    plan: TracePlan
    passes: dict[tuple[Depth, int], StepTrace]
    optimizer: dict[Depth, StepTrace] | None
    size: ModelSize
    """The full model's exact size as the recipe trains it (the meta-device count): what the traces must add up to,
    and what the estimate's other arithmetic reads of the model."""
    notes: tuple[str, ...]
    """What the Estimate must say of how it was traced (plans other than uniform, a count that
    does not add up)."""

    @property
    def parameters(self) -> int:
        return self.size.parameters

    @property
    def trainable_parameters(self) -> int:
        return self.size.trainable_parameters


def step_traces(workload: Workload, recipe: ResolvedRecipe, compute_capability: str, mode: Mode = "train",
                *, use_cache: bool = True, num_gpus: int = 1) -> StepTraces:
    """The passes of each cut of the plan at TRACE_BATCHES and, in training, the optimizer of each cut;
    at full depth instead where the parameters they imply are not the model's exact count. An FSDP
    recipe's are one rank's of `num_gpus` (`trace.step.fsdp`); a DeepSpeed ZeRO recipe's are of its step as the
    engine runs it (`sharding.as_deepspeed_runs`)."""
    check_traceable(workload, recipe)  # before the caches: a config's experts kernel is not in their keys
    recipe = as_deepspeed_runs(recipe)
    model = model_plan(workload, recipe, use_cache=use_cache)
    if recipe.fsdp != "none" and model.size.blocks == 0:
        raise InputError(f"{workload.name}: FSDP shards a model block by block, and this model has no repeated block to "
                         "wrap (its layers are shared or unlisted); use DeepSpeed ZeRO (--zero-stage) instead")

    def traced(plan: TracePlan) -> StepTraces:
        parts = parts_of(plan, mode)
        if use_cache:
            trace_parts(workload, [PartRequest(recipe, *p, num_gpus) for p in parts], compute_capability)
        traces = {(part, c, b): trace_part(workload, recipe, part, depth=c, batch_size=b,
                                           compute_capability=compute_capability, use_cache=use_cache,
                                           num_gpus=num_gpus)
                  for part, c, b in parts}
        passes = {(c, b): t for (part, c, b), t in traces.items() if part != "optimizer"}
        optimizer = {c: t for (part, c, _), t in traces.items() if part == "optimizer"} if mode == "train" else None
        return StepTraces(plan=plan, passes=passes, optimizer=optimizer, size=model.size,
                          notes=(plan.note,) if plan.note else ())

    traces = traced(model.plan)
    implied = implied_parameters(traces)
    exact = (model.size.parameters, model.size.trainable_parameters)
    if implied != exact and model.plan.how != "full":
        why = (f"the traced cuts imply {implied[0]:,} parameters ({implied[1]:,} trainable), the model has "
               f"{exact[0]:,} ({exact[1]:,})")
        traces = traced(full_plan(model.size.blocks, why))
        implied = implied_parameters(traces)
    if implied != exact:
        note = (f"the traces count {implied[0]:,} parameters ({implied[1]:,} trainable) but the model built on "
                f"the meta device has {exact[0]:,} ({exact[1]:,}): memory and time may be off accordingly")
        traces = dataclasses.replace(traces, notes=(*traces.notes, note))
    return traces


def parts_of(plan: TracePlan, mode: Mode) -> list[tuple[Part, Depth, int]]:
    """(part, cut, batch size) of each trace `step_traces` reads for `plan`: the passes of each cut at
    TRACE_BATCHES and, in training, the optimizer of each cut."""
    part: Part = "forward-backward" if mode == "train" else "inference"
    parts: list[tuple[Part, Depth, int]] = [(part, c, b) for c in plan.cuts for b in TRACE_BATCHES]
    if mode == "train":
        parts += [("optimizer", c, 1) for c in plan.cuts]
    return parts


def prefetch(workload: Workload, recipes: Iterable[ResolvedRecipe], compute_capability: str, mode: Mode = "train",
             *, num_gpus: int = 1) -> None:
    """Trace side by side what `step_traces` of each recipe on `num_gpus` devices will read (see
    `trace.store.parts.trace_parts`)."""
    requests = []
    for recipe in map(as_deepspeed_runs, recipes):
        try:
            check_traceable(workload, recipe)
        except InputError:
            continue  # step_traces says so, in its turn
        plan = model_plan(workload, recipe).plan
        requests += [PartRequest(recipe, *p, num_gpus) for p in parts_of(plan, mode)]
    trace_parts(workload, requests, compute_capability)


def offloaded_bytes(traces: StepTraces, batch: int) -> float:
    """Bytes one micro-batch of `batch` samples of the full model copies to the host (TRL's activation offloading)."""
    lo, hi = TRACE_BATCHES
    return traces.plan.combine(lambda c: affine(float(traces.passes[c, lo].offloaded_bytes),
                                                float(traces.passes[c, hi].offloaded_bytes), batch, lo))


def implied_parameters(traces: StepTraces) -> tuple[int, int]:
    """(parameters, trainable parameters) of the full model as the plan adds the traces up."""
    at = {c: traces.passes[c, TRACE_BATCHES[0]] for c in traces.plan.cuts}
    return (round(traces.plan.combine(lambda c: at[c].parameters)),
            round(traces.plan.combine(lambda c: at[c].trainable_parameters)))
