"""`plan()`: predict memory and time of every recipe of the space, keep what fits, rank.

Memory comes from `estimate_memory` (fake-tensor traces, cached per trace-shaping fields, so
batch size, accumulation and sharding variations are arithmetic); time from the time model
(`throughput.predict_time`). A recipe fits when its predicted device total (what
nvidia-smi would show) is at most (1 - margin) x the GPU's memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN, GIB, TimeAnatomy
from anatomist.axes.precisions import searchable_on
from anatomist.errors import InputError
from anatomist.estimate.communication import TimeModel, predict_time
from anatomist.estimate.memory import MemoryEstimate, estimate_memory, memory_limit_bytes
from anatomist.estimate.traces import prefetch
from anatomist.hardware import GPU, catalog
from anatomist.plan.space import SearchSpace, enumerate_recipes
from anatomist.recipe import Recipe, ResolvedRecipe
from anatomist.trace import pool
from anatomist.workload import Workload

Objective = Literal["throughput", "memory"]
@dataclass(kw_only=True, slots=True)
class Candidate:
    """One recipe with its predictions."""

    recipe: ResolvedRecipe
    memory: MemoryEstimate
    time: TimeAnatomy
    fits: bool
    reasons: list[str] = field(default_factory=list)

    @property
    def device_total(self) -> int:
        total = self.memory.anatomy.device_total
        assert total is not None  # an estimate always has one (only a CPU measurement has none)
        return total

    @property
    def samples_per_second(self) -> float:
        return self.time.samples_per_second

    def to_dict(self) -> dict[str, Any]:
        memory = self.memory.anatomy.to_dict()
        memory["fits"] = self.fits
        return {"recipe": self.recipe.to_dict(), "memory": memory, "time": self.time.to_dict(), "reasons": self.reasons}


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


class Evaluator:
    """Predicts (and remembers) memory and time of recipes for one workload, GPU and device count."""

    def __init__(self, workload: Workload, gpu: GPU, num_gpus: int, margin: float, time_model: TimeModel) -> None:
        self.workload, self.gpu, self.num_gpus, self.margin = workload, gpu, num_gpus, margin
        self.time_model = time_model
        self.seen: dict[Recipe, Candidate] = {}

    def __call__(self, recipe: Recipe) -> Candidate:
        """The candidate of `recipe` (resolved here for the workload: the plan's entry point for each recipe)."""
        recipe = recipe.resolved(self.workload)
        if recipe not in self.seen:
            memory = estimate_memory(self.workload, recipe, self.gpu, num_gpus=self.num_gpus, margin=self.margin)
            time = self.time_model(self.workload, recipe, self.gpu, num_gpus=self.num_gpus)
            self.seen[recipe] = Candidate(recipe=recipe, memory=memory, time=time, fits=memory.fits)
        return self.seen[recipe]


def pareto_front(candidates: list[Candidate]) -> list[Candidate]:
    """Candidates no other beats on both throughput (higher) and device memory (lower)."""
    front: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: (c.device_total, -c.samples_per_second)):
        if not front or c.samples_per_second > front[-1].samples_per_second:
            front.append(c)
    return front


def _simplicity(recipe: Recipe) -> tuple[int, ...]:
    """Tie-break among equally fast recipes: fewer moving parts first (every weight trained, no
    compile, no sharding, no checkpointing, AdamW), then a per-device batch that is a multiple of 8."""
    return (
        int(recipe.peft != "none") + int(recipe.quantized),
        int(recipe.torch_compile),
        recipe.sharding_stage,
        int(recipe.offload != "none"),
        int(recipe.gradient_checkpointing),
        int(recipe.optim != "adamw_torch_fused"),
        int(recipe.per_device_train_batch_size % 8 != 0),
        recipe.gradient_accumulation_steps,
    )


SPEED_TIE = 0.005
"""Throughputs within 0.5% of each other are a tie (below any time model's resolution)."""


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
    from anatomist.plan.reasons import explain, explain_infeasible

    space = space or SearchSpace()
    if workload.is_moe and space.precisions is None:
        if not gpu.bf16:
            raise InputError(f"{workload.name}: its Mixture-of-Experts layers need bfloat16 weights, which {gpu.name} lacks")
        space = dataclasses.replace(space, precisions=("bf16-weights",))  # grouped_mm takes bf16 only
    limit = memory_limit_bytes(gpu, margin)
    if objective not in ("throughput", "memory"):
        raise InputError(f"--objective must be throughput or memory, got {objective!r}")
    evaluate = Evaluator(workload, gpu, space.num_gpus, margin, time_model or predict_time)
    recipes = [r.resolved(workload) for r in enumerate_recipes(space, gpu)]
    with pool.kept():  # the workers that trace the candidates then trace the alternatives the reasons compare
        prefetch(workload, recipes, gpu.compute_capability, num_gpus=space.num_gpus)  # every trace, side by side
        candidates = [evaluate(r) for r in recipes]
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
    if not calibrated:
        notes.append("time: uncalibrated (roofline placeholders in data/time_calibration.toml, not fitted on a GPU); "
                     "a ranking, not a measurement")
    return Plan(
        workload=workload, gpu=gpu, space=space, objective=objective, margin=margin, limit_bytes=limit,
        candidates=candidates, pareto=front, best=best, time_calibrated=calibrated, notes=notes,
    )


def choose(feasible: list[Candidate], objective: Objective) -> Candidate:
    """Throughput: among recipes within SPEED_TIE of the fastest, the simplest.
    Memory: the smallest device total, then the fastest."""
    if objective == "memory":
        return min(feasible, key=lambda c: (c.device_total, -c.samples_per_second, _simplicity(c.recipe)))
    top = max(c.samples_per_second for c in feasible)
    near = [c for c in feasible if c.samples_per_second >= top * (1 - SPEED_TIE)]
    return min(near, key=lambda c: (_simplicity(c.recipe), -c.samples_per_second))


def smallest_fitting_gpu(need_bytes: int, margin: float, gpu: GPU) -> GPU | None:
    """The catalog GPU with the least memory that would hold `need_bytes` (context size adjusted)."""
    fitting = [
        g for g in catalog().values()
        if need_bytes - gpu.cuda_context_bytes + g.cuda_context_bytes <= g.memory_bytes * (1 - margin)
    ]
    return min(fitting, key=lambda g: g.memory_bytes, default=None)
