"""`plan()`: predict memory and time of every recipe of the space, keep what fits, rank.

Memory comes from `estimate_memory` (fake-tensor traces, cached per trace-shaping fields, so
batch size, accumulation and sharding variations are arithmetic); time from the time model
(`cluster.predict_time`). A recipe fits when the top of its predicted device total's interval (what
nvidia-smi would show, as far above the prediction as published GPU runs were: `estimate.intervals`) is at most
(1 - margin) x the GPU's memory; among recipes the time model cannot rank (predicted within its median held-out
error of the fastest: `candidates.speed_error`) the pick prefers headroom, then the simplest (`candidates.choose`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN, GIB
from anatomist.axes.precisions import searchable_on
from anatomist.axes.shardings import shardings_for
from anatomist.errors import InputError
from anatomist.estimate.memory import memory_limit_bytes
from anatomist.estimate.time.cluster import UNFITTED_TERMS, TimeModel, adds_device_terms, predict_time
from anatomist.estimate.time.network import check_cluster, cluster_fields, describe_network
from anatomist.estimate.time.ops import recomputing_nothing
from anatomist.estimate.traces import prefetch
from anatomist.hardware import GPU
from anatomist.plan.candidates import (
    SPEED_TIE,
    Candidate,
    Evaluator,
    Objective,
    choose,
    pareto_front,
    speed_error,
    speed_note,
    with_pick,
)
from anatomist.plan.reasons import explain, explain_infeasible
from anatomist.plan.space import (
    SearchSpace,
    can_offload_activations,
    enumerate_recipes,
    partial_variants,
    valid,
)
from anatomist.plan.splits import (
    context_parallel_note,
    context_parallel_variants,
    expert_parallel_note,
    expert_parallel_variants,
    sequence_parallel_note,
    sequence_parallel_variants,
    tensor_parallel_note,
    tensor_parallel_variants,
)
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.store import pool
from anatomist.trace.store.keys import one_device
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
    speed_error: float
    """Relative speed difference below which the plan does not rank two recipes (`candidates.speed_error`)."""
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
            "speed_error": self.speed_error,
            "candidates": len(self.candidates),
            "feasible": len(self.feasible),
            "pareto": [c.to_dict() for c in self.pareto],
            "best": self.best.to_dict(),
            "notes": self.notes,
        }


def checkpointing_variants(recipes: list[ResolvedRecipe], best: Candidate | None, evaluate: Evaluator,
                           objective: Objective, space: SearchSpace) -> list[ResolvedRecipe]:
    """The searched recipes' checkpointing refined where it can pay (each needs traces of its own, so only there):

    - checkpointing one layer in N (`space.partial_checkpointing`) of the recipes that fit by checkpointing every
      layer where the same recipe without checkpointing does not fit but would beat `best` (the best that fits);
    - offloading the checkpoints (`space.offload_checkpoints`) of the recipes that checkpoint every layer and do not
      fit, where they would beat `best`, or nothing fits, or the objective is memory;
    - under TRL's trainers, their activation offloading (`space.offload_activations`) of the recipes that do not fit,
      on the same terms.

    Whether a recipe fits is asked of `evaluate` only where its speed leaves the answer open, so that a search that
    has not predicted the memory of every recipe (`fastest_fitting`) finds the same variants.
    """
    if {"gradient_checkpointing", "checkpoint_every", "checkpoint_offload", "activation_offloading"} & set(space.fixed):
        return []
    searched = set(recipes)

    def beats_best(recipe: ResolvedRecipe) -> bool:
        return (best is None or objective == "memory"
                or evaluate.time(recipe).samples_per_second > best.samples_per_second * (1 + SPEED_TIE))

    every_layer = [r for r in recipes if r.checkpoints_every_layer]
    open_plain = [r for r in every_layer if objective == "throughput"
                  and not (r.torch_compile and r.use_liger_kernel)  # compiled Liger is modelled only checkpointed
                  and (plain := r.replace(gradient_checkpointing=False)) in searched
                  and beats_best(plain) and not evaluate(plain).fits]
    _trace_ahead(evaluate, open_plain)
    variants = partial_variants([r for r in open_plain if evaluate(r).fits], space)
    if space.offload_checkpoints:
        variants += [v for r in every_layer if beats_best(r) and (objective == "memory" or not evaluate(r).fits)
                     for v in valid(r, checkpoint_offload=True)]  # not under a split that refuses it
    if space.offload_activations:
        variants += [r.replace(activation_offloading=True) for r in recipes if can_offload_activations(r)
                     and not r.activation_offloading and beats_best(r) and (objective == "memory" or not evaluate(r).fits)]
    return list(dict.fromkeys(variants))


def _with_variants(recipes: list[ResolvedRecipe], candidates: list[Candidate], evaluate: Evaluator,
                   objective: Objective, space: SearchSpace, error: float, limit: int) -> list[Candidate]:
    """`candidates` and the variants the search adds after them, each kind against the best that fits so far:
    checkpointing where it can pay (`checkpointing_variants`), then tensor parallel (`tensor_parallel_variants`), then
    expert parallel (`expert_parallel_variants`), then context parallel (`context_parallel_variants`) and DeepSpeed's
    sequence parallel (`sequence_parallel_variants`), then the split
    recipes' own checkpointing (one that fits checkpointing every layer may fit checkpointing fewer, which the first
    pass, over the recipes before the split, could not find)."""
    split: list[ResolvedRecipe] = []
    stages = ((checkpointing_variants, recipes), (tensor_parallel_variants, recipes), (expert_parallel_variants, recipes),
              (context_parallel_variants, recipes), (sequence_parallel_variants, recipes),
              (checkpointing_variants, split))
    for variants_of, searched in stages:
        feasible = [c for c in candidates if c.fits]
        best = choose(feasible, objective, speed_error=error, limit=limit) if feasible else None
        variants = variants_of(searched, best, evaluate, objective, space) if searched else []
        if variants:
            _trace_ahead(evaluate, variants)
            candidates = candidates + [evaluate(r) for r in variants]
            split += [r for r in variants if r.split_by_transformers or r.sequence_parts > 1]
    return candidates


def _searched(workload: Workload, gpu: GPU, space: SearchSpace | None, objective: Objective,
              margin: float) -> tuple[SearchSpace, int, list[ResolvedRecipe]]:
    """The space settled for the workload, the memory limit and the recipes to search, in order.

    Raises:
        InputError: bad margin/objective/cluster, or a space with no recipe.
    """
    space = (space or SearchSpace()).for_workload(workload.model_type, workload.task)
    limit = memory_limit_bytes(gpu, margin)
    if objective not in ("throughput", "memory"):
        raise InputError(f"--objective must be throughput or memory, got {objective!r}")
    check_cluster(space.num_gpus, space.nodes, space.network)
    if not space.sharding_options():
        asked_hsdp = space.nodes == 1 and "hsdp" in (space.shardings or ())
        across = " (hsdp replicates across nodes: --nodes 2 or more)" if asked_hsdp else ""
        raise InputError(f"--shardings {','.join(space.shardings or ())}: none runs on {space.num_gpus} GPU(s) of "
                         f"{space.nodes} node(s), where the options are "
                         f"{', '.join(shardings_for(space.num_gpus, space.nodes))}{across}")
    recipes = list(dict.fromkeys(r.resolved(workload) for r in enumerate_recipes(space, gpu)))
    if not recipes:
        raise InputError(f"the fields the recipe file fixes ({', '.join(f'{k}={v}' for k, v in space.fixed.items())}) "
                         f"leave no recipe to search on {space.num_gpus} x {gpu.name}"
                         + (f" with a global batch of {space.global_batch_size}" if space.global_batch_size else "")
                         + (f" and --shardings {','.join(space.shardings)}" if space.shardings else ""))
    return space, limit, recipes


def _trace_ahead(evaluate: Evaluator, recipes: list[ResolvedRecipe]) -> None:
    """Trace side by side what predicting the memory of those of `recipes` not yet evaluated reads."""
    prefetch(evaluate.workload, [r for r in recipes if r not in evaluate.seen], evaluate.gpu.compute_capability,
             num_gpus=evaluate.num_gpus)


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
    space, limit, recipes = _searched(workload, gpu, space, objective, margin)
    evaluate = Evaluator(workload, gpu, space, margin, time_model or predict_time)
    with pool.kept():  # the workers that trace the candidates then trace the alternatives the reasons compare
        _trace_ahead(evaluate, recipes)  # every trace, side by side
        candidates = [evaluate(r) for r in recipes]
        error = speed_error(c.time for c in candidates)
        candidates = _with_variants(recipes, candidates, evaluate, objective, space, error, limit)
        feasible = [c for c in candidates if c.fits]
        if not feasible:
            raise InputError(explain_infeasible(workload, gpu, space, candidates, limit, margin))
        best = choose(feasible, objective, speed_error=error, limit=limit)
        best.reasons = explain(best, evaluate, space, objective, limit, speed_error=error)
    calibrated = all(c.time.calibrated for c in candidates)
    front = with_pick(pareto_front(feasible), best)
    _, precision_notes = searchable_on(gpu)
    for c in front:
        if c is not best and not c.reasons:
            c.reasons = [f"Pareto front: {c.samples_per_second:.1f} samples/s at {c.device_total / GIB:.2f} GiB"]
    notes = [workload.config_note] if workload.config_note else []  # a catalog alias: which config stands in
    notes.append(f"memory margin: {margin * 100:.3g}% of {gpu.memory_bytes / GIB:.2f} GiB kept free; "
                 f"limit {limit / GIB:.2f} GiB")
    notes += precision_notes
    if len(space.methods) > 1:
        notes.append(f"fine-tuning: searched {', '.join(space.methods)}; LoRA/QLoRA train r={space.base.lora_r} adapters "
                     "on a frozen base (a different fine-tune from full), without ZeRO/FSDP")
    if space.nodes > 1:
        notes.append(describe_network(space.num_gpus, space.nodes, space.network, gpu))
    if space.shardings is not None:
        notes.append("shardings searched (--shardings): " + ", ".join(spec.name for spec in space.sharding_options()))
    notes += (tensor_parallel_note(space, workload, candidates) + expert_parallel_note(space, workload, candidates)
              + context_parallel_note(space, workload, candidates) + sequence_parallel_note(space, workload, candidates))
    if space.fixed:
        notes.append("held fixed by --recipe: " + ", ".join(f"{k}={v}" for k, v in space.fixed.items()))
    notes.append(f"{best.time.calibration}; {UNFITTED_TERMS}" if adds_device_terms(best.recipe, space.num_gpus)
                 else best.time.calibration)
    if objective == "throughput":
        notes.append(speed_note(best.time, error))
    return Plan(
        workload=workload, gpu=gpu, space=space, objective=objective, margin=margin, limit_bytes=limit,
        candidates=candidates, pareto=front, best=best, time_calibrated=calibrated, speed_error=error, notes=notes,
    )


def fastest_fitting(
    workload: Workload,
    gpu: GPU,
    *,
    space: SearchSpace | None = None,
    objective: Objective = "throughput",
    margin: float = DEFAULT_MEMORY_MARGIN,
    time_model: TimeModel | None = None,
) -> Candidate:
    """The recipe `plan(...)` picks (`Plan.best`, without its reasons), predicting the memory of only the recipes
    that could be it: what `plan --max-nodes` needs of the cluster sizes it does not choose.

    The time of every recipe comes first: it reads one device's traces (`Evaluator.time`), which every sharding
    shares. The memory then goes fastest first: the first recipe that fits is the fastest that fits, and only the
    recipes within `candidates.speed_error` of it can be chosen; the memory of the slower ones (above all the FSDP recipes' own
    traces, one per world size) is never predicted. The choice among those within the tie is `choose`'s, over
    the recipes in the search's own order, so a tie is broken as `plan` breaks it.

    Raises:
        InputError: as `plan` (where nothing fits, `plan` itself runs to say why).
    """
    if objective != "throughput":  # the smallest device total: every recipe's memory is needed
        return plan(workload, gpu, space=space, objective=objective, margin=margin, time_model=time_model).best
    settled, _, recipes = _searched(workload, gpu, space, objective, margin)
    evaluate = Evaluator(workload, gpu, settled, margin, time_model or predict_time)
    with pool.kept():
        best = _fastest_of(recipes, evaluate)
        if best is None:
            return plan(workload, gpu, space=space, objective=objective, margin=margin, time_model=time_model).best
        variants = checkpointing_variants(recipes, best, evaluate, objective, settled)
        if variants:
            best = _fastest_of(recipes + variants, evaluate) or best
        split = tensor_parallel_variants(recipes, best, evaluate, objective, settled)
        if split:
            best = _fastest_of(recipes + variants + split, evaluate) or best
    return best


def _fastest_of(recipes: list[ResolvedRecipe], evaluate: Evaluator) -> Candidate | None:
    """`choose(feasible, "throughput")` of `recipes`, their memory predicted fastest first, in bands of the speed
    error, until the recipes left are slower than the fastest that fits by more than it (`fastest_fitting`)."""
    prefetch(evaluate.workload, _time_traced(recipes), evaluate.gpu.compute_capability, num_gpus=evaluate.num_gpus)
    times = [evaluate.time(r) for r in recipes]
    error = speed_error(times)
    speeds = [t.samples_per_second for t in times]
    fastest_first = sorted(zip(speeds, recipes, strict=True), key=lambda pair: -pair[0])
    top: float | None = None
    start = 0
    while start < len(fastest_first):
        floor = (top if top is not None else fastest_first[start][0]) * (1 - error)
        band = []
        for speed, recipe in fastest_first[start:]:
            if speed < floor:
                break
            band.append(recipe)
        if not band:
            break
        _trace_ahead(evaluate, band)
        fitting = [evaluate(r).samples_per_second for r in band if evaluate(r).fits]
        if top is None and fitting:
            top = max(fitting)
        start += len(band)
    feasible = [evaluate(r) for r in recipes if r in evaluate.seen and evaluate(r).fits]
    return (choose(feasible, "throughput", speed_error=error, limit=memory_limit_bytes(evaluate.gpu, evaluate.margin))
            if feasible else None)


def _time_traced(recipes: list[ResolvedRecipe]) -> list[ResolvedRecipe]:
    """The recipes whose traces the time of `recipes` reads: one device's step (`keys.one_device`) and, where it
    checkpoints, the same step without (its model FLOPs: `ops.step_flops`)."""
    one = [one_device(r) for r in recipes]
    plain = [recomputing_nothing(r) for r in one if r.gradient_checkpointing]
    return list(dict.fromkeys(one + plain))
