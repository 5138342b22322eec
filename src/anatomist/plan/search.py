"""`plan()`: predict memory and time of every recipe of the space, keep what fits, rank.

Memory comes from `estimate_memory` (fake-tensor traces, cached per trace-shaping fields, so
batch size, accumulation and sharding variations are arithmetic); time from the time model
(`communication.predict_time`). A recipe fits when its predicted device total (what
nvidia-smi would show) is at most (1 - margin) x the GPU's memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN, GIB
from anatomist.axes.precisions import searchable_on
from anatomist.errors import InputError
from anatomist.estimate.communication import (
    UNFITTED_TERMS,
    TimeModel,
    adds_device_terms,
    check_cluster,
    cluster_fields,
    describe_network,
    predict_time,
)
from anatomist.estimate.memory import memory_limit_bytes
from anatomist.estimate.traces import prefetch
from anatomist.hardware import GPU
from anatomist.plan.candidates import SPEED_TIE, Candidate, Evaluator, Objective, choose, pareto_front
from anatomist.plan.reasons import explain, explain_infeasible
from anatomist.plan.space import SearchSpace, enumerate_recipes, partial_variants
from anatomist.recipe import ResolvedRecipe
from anatomist.trace import pool
from anatomist.workload import Workload


@dataclass(kw_only=True, slots=True)
class Plan:
    """The search's result: what `anatomist plan --json` prints."""

    workload: Workload
    gpu: GPU
    space: SearchSpace
    objective: Objective
    margin: float
    limit_bytes: int
    """(1 - margin) x GPU memory: the most a recipe's device total may be."""
    candidates: list[Candidate]
    pareto: list[Candidate]
    best: Candidate
    time_calibrated: bool
    notes: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.workload.name,
            "seq_len": self.workload.seq_len,
            "gpu": {"name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes},
            "num_gpus": self.space.num_gpus,
            **cluster_fields(self.space.nodes, self.space.network),
            "global_batch_size": self.space.global_batch_size,
            "objective": self.objective,
            "memory_margin": self.margin,
            "limit_bytes": self.limit_bytes,
            "time_calibrated": self.time_calibrated,
            "candidates": len(self.candidates),
            "feasible": len(self.feasible),
            "pareto": [c.to_dict() for c in self.pareto],
            "best": self.best.to_dict(),
            "notes": self.notes,
        }


def checkpointing_variants(candidates: list[Candidate], objective: Objective, space: SearchSpace) -> list[ResolvedRecipe]:
    """The searched recipes' checkpointing refined where it can pay (each needs traces of its own, so only there):

    - checkpointing one layer in N (`space.partial_checkpointing`) of the recipes that fit by checkpointing every
      layer where the same recipe without checkpointing does not fit but would beat the best that fits;
    - offloading the checkpoints (`space.offload_checkpoints`) of the recipes that checkpoint every layer and do not
      fit, where they would beat the best that fits, or nothing fits, or the objective is memory.
    """
    if "gradient_checkpointing" in space.fixed or "checkpoint_every" in space.fixed or "checkpoint_offload" in space.fixed:
        return []
    feasible = [c for c in candidates if c.fits]
    best = choose(feasible, objective) if feasible else None
    by_recipe = {c.recipe: c for c in candidates}

    def beats_best(c: Candidate) -> bool:
        return best is None or objective == "memory" or c.samples_per_second > best.samples_per_second * (1 + SPEED_TIE)

    every_layer = [c for c in candidates if c.recipe.checkpointing == "on"]
    between = [c.recipe for c in every_layer if c.fits and objective == "throughput"
               and (plain := by_recipe.get(c.recipe.replace(gradient_checkpointing=False))) is not None
               and not plain.fits and beats_best(plain)]
    variants = partial_variants(between, space)
    if space.offload_checkpoints:
        variants += [c.recipe.replace(checkpoint_offload=True) for c in every_layer
                     if (not c.fits or objective == "memory") and beats_best(c)]
    return list(dict.fromkeys(variants))


def plan(
    workload: Workload,
    gpu: GPU,
    *,
    space: SearchSpace | None = None,
    objective: Objective = "throughput",
    margin: float = DEFAULT_MEMORY_MARGIN,
    time_model: TimeModel | None = None,
) -> Plan:
    """Search `space` for the fastest (or smallest) recipe that fits `gpu` with `margin` kept free.

    Raises:
        InputError: bad margin/objective, or no recipe fits (the message says what is short,
            by how much, and what would fit).
    """
    space = (space or SearchSpace()).for_workload(workload.model_type, workload.task)
    if workload.is_moe and space.precisions is None:
        if not gpu.bf16:
            raise InputError(f"{workload.name}: its Mixture-of-Experts layers need bfloat16 weights, which {gpu.name} lacks")
        space = dataclasses.replace(space, precisions=("bf16-weights",))  # grouped_mm takes bf16 only
    limit = memory_limit_bytes(gpu, margin)
    if objective not in ("throughput", "memory"):
        raise InputError(f"--objective must be throughput or memory, got {objective!r}")
    check_cluster(space.num_gpus, space.nodes, space.network)
    evaluate = Evaluator(workload, gpu, space, margin, time_model or predict_time)
    recipes = list(dict.fromkeys(r.resolved(workload) for r in enumerate_recipes(space, gpu)))
    if not recipes:
        raise InputError(f"the fields the recipe file fixes ({', '.join(f'{k}={v}' for k, v in space.fixed.items())}) "
                         f"leave no recipe to search on {space.num_gpus} x {gpu.name}"
                         + (f" with a global batch of {space.global_batch_size}" if space.global_batch_size else ""))
    with pool.kept():  # the workers that trace the candidates then trace the alternatives the reasons compare
        prefetch(workload, recipes, gpu.compute_capability, num_gpus=space.num_gpus)  # every trace, side by side
        candidates = [evaluate(r) for r in recipes]
        feasible = [c for c in candidates if c.fits]
        variants = checkpointing_variants(candidates, objective, space)
        if variants:
            prefetch(workload, variants, gpu.compute_capability, num_gpus=space.num_gpus)
            candidates += [evaluate(r) for r in variants]
            feasible = [c for c in candidates if c.fits]
        if not feasible:
            raise InputError(explain_infeasible(workload, gpu, space, candidates, limit, margin))
        best = choose(feasible, objective)
        best.reasons = explain(best, evaluate, space, objective, limit)
    calibrated = all(c.time.calibrated for c in candidates)
    front = pareto_front(feasible)
    _, precision_notes = searchable_on(gpu)
    for c in front:
        if c is not best and not c.reasons:
            c.reasons = [f"Pareto front: {c.samples_per_second:.1f} samples/s at {c.device_total / GIB:.2f} GiB"]
    notes = [f"memory margin: {margin * 100:.3g}% of {gpu.memory_bytes / GIB:.2f} GiB kept free; limit {limit / GIB:.2f} GiB"]
    notes += precision_notes
    if len(space.methods) > 1:
        notes.append(f"fine-tuning: searched {', '.join(space.methods)}; LoRA/QLoRA train r={space.base.lora_r} adapters "
                     "on a frozen base (a different fine-tune from full), without ZeRO/FSDP")
    if space.nodes > 1:
        notes.append(describe_network(space.num_gpus, space.nodes, space.network, gpu))
    if space.fixed:
        notes.append("held fixed by --recipe: " + ", ".join(f"{k}={v}" for k, v in space.fixed.items()))
    notes.append(f"{best.time.calibration}; {UNFITTED_TERMS}" if adds_device_terms(best.recipe, space.num_gpus)
                 else best.time.calibration)
    return Plan(
        workload=workload, gpu=gpu, space=space, objective=objective, margin=margin, limit_bytes=limit,
        candidates=candidates, pareto=front, best=best, time_calibrated=calibrated, notes=notes,
    )


