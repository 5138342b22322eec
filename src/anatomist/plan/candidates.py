"""One candidate recipe with its predictions, how candidates are evaluated and compared.

Shared by the search (`search.py`) and the reasons it gives (`reasons.py`): memory from
`estimate_memory`, time from the plan's time model; the Pareto front, the simplicity order that
breaks speed ties, the choice, and the smallest catalog GPU that would hold a need.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from anatomist.anatomy import TimeAnatomy
from anatomist.estimate.memory import MemoryEstimate, estimate_memory
from anatomist.estimate.time.cluster import TimeModel
from anatomist.hardware import GPU, catalog
from anatomist.recipe import Recipe, ResolvedRecipe
from anatomist.workload import Workload

if TYPE_CHECKING:
    from anatomist.plan.space import SearchSpace

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

    @property
    def device_total_high(self) -> int:
        """The top of the device total's interval: what a plan's pick must fit with."""
        return round(self.memory.interval.high)

    def to_dict(self) -> dict[str, Any]:
        memory = self.memory.anatomy_dict()
        memory["fits"] = self.fits
        memory["verdict"] = self.memory.verdict
        return {"recipe": self.recipe.to_dict(), "memory": memory, "time": self.time.to_dict(), "reasons": self.reasons}


class Evaluator:
    """Predicts (and remembers) memory and time of recipes for one workload, GPU and device count."""

    def __init__(self, workload: Workload, gpu: GPU, space: SearchSpace, margin: float, time_model: TimeModel) -> None:
        self.workload, self.gpu, self.num_gpus, self.margin = workload, gpu, space.num_gpus, margin
        self.nodes, self.network = space.nodes, space.network
        self.time_model = time_model
        self.seen: dict[Recipe, Candidate] = {}
        self.times: dict[Recipe, TimeAnatomy] = {}

    def __call__(self, recipe: Recipe) -> Candidate:
        """The candidate of `recipe` (resolved here for the workload: the plan's entry point for each recipe)."""
        recipe = recipe.resolved(self.workload)
        if recipe not in self.seen:
            workload = self.workload.for_recipe(recipe)  # padding-free: the data's sequences
            memory = estimate_memory(workload, recipe, self.gpu, num_gpus=self.num_gpus, margin=self.margin)
            self.seen[recipe] = Candidate(recipe=recipe, memory=memory, time=self.time(recipe),
                                          fits=memory.verdict == "fits")
        return self.seen[recipe]

    def time(self, recipe: ResolvedRecipe) -> TimeAnatomy:
        """The predicted time of `recipe` alone: it reads one device's traces only (`keys.one_device`), never a
        sharded recipe's own."""
        if recipe not in self.times:
            self.times[recipe] = self.time_model(self.workload.for_recipe(recipe), recipe, self.gpu,
                                                 num_gpus=self.num_gpus, nodes=self.nodes, network=self.network)
        return self.times[recipe]


def pareto_front(candidates: list[Candidate]) -> list[Candidate]:
    """Candidates no other beats on both throughput (higher) and device memory (lower)."""
    front: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: (c.device_total, -c.samples_per_second)):
        if not front or c.samples_per_second > front[-1].samples_per_second:
            front.append(c)
    return front


def _simplicity(recipe: Recipe) -> tuple[int, ...]:
    """Tie-break among equally fast recipes: fewer moving parts first (every weight trained, no
    compile, no Liger, no sharding, no checkpointing, every block's rather than some, AdamW), then a per-device batch that is a multiple of 8."""
    return (
        int(recipe.peft != "none") + int(recipe.quantized),
        int(recipe.torch_compile),
        int(recipe.use_liger_kernel),
        recipe.sharding_stage,
        int(recipe.offload != "none"),
        int(recipe.gradient_checkpointing),
        int(recipe.checkpoint_every > 1),
        int(recipe.optim != "adamw_torch_fused"),
        int(recipe.per_device_train_batch_size % 8 != 0),
        recipe.gradient_accumulation_steps,
    )


SPEED_TIE = 0.005
"""Throughputs within 0.5% of each other are a tie (below any time model's resolution)."""


SPEED_UP_ERROR = 0.10
"""The most a method's predicted speed-up over another recipe on the same GPU is off on the one published check
that timed recipes side by side (the guide's V100 table: 8.4% worst, docs/time.md), as
tests/test_time_published.py::test_the_guides_v100_table holds it."""


def speed_error(times: Iterable[TimeAnatomy]) -> float:
    """How close two recipes' predicted speeds on the same GPU may be and still not be ranked: the median |held-out
    error| of the step time with the calibration the `times` used (`TimeAnatomy.error_median_pct`, the GPU
    generation's leave-one-source-out median; a measured calibration's in-sample one), at least SPEED_TIE and at
    most SPEED_UP_ERROR.

    The cap: a generation's step-time error is mostly a level that its sources disagree on (H100's 15%: Lambda's
    BERT and llm-foundry's MPT need different efficiencies; GA10x's 46%: Lambda's A10 and RTX 3090), common to every
    recipe compared on that GPU; where recipes were timed side by side, their ratios were predicted within
    SPEED_UP_ERROR. Without it a plan on an A10 would pass over recipes predicted up to 46% faster for headroom."""
    return min(SPEED_UP_ERROR, max([SPEED_TIE, *((t.error_median_pct or 0.0) / 100 for t in times)]))


def speed_note(time: TimeAnatomy, error: float) -> str:
    """The plan's note on how close speeds go unranked (`error`, from `speed_error`), and why: the median held-out
    error of `time`'s calibration, or the cap where that median is wider."""
    median = (time.error_median_pct or 0.0) / 100
    why = (f"the time model's median held-out error is {median:.0%}, capped at how far off speed-ups between recipes "
           "timed side by side were" if median > error else "the time model's median held-out error")
    return (f"speed: recipes predicted within {error:.0%} of the fastest are not ranked ({why}); of them the pick keeps "
            "the most headroom, then prefers the simplest")


HEADROOM_STEP = 0.05
"""Share of the memory limit below which two recipes' headroom counts as the same when the pick prefers headroom: a
pick does not trade AdamW for Adafactor to keep 50 MiB more free."""


def choose(feasible: list[Candidate], objective: Objective, *, speed_error: float = 0.0, limit: int = 0) -> Candidate:
    """Throughput: the recipes predicted within `speed_error` of the fastest, which the time model cannot rank; of
    them those with the most headroom at the top of their memory interval (within HEADROOM_STEP of `limit` of the
    most), and of those the simplest, then the fastest. Memory: the smallest device total, then the fastest.

    A throughput pick is on the Pareto front (throughput vs device total) but where a recipe at least as fast needs a
    little less memory (less than HEADROOM_STEP of `limit`) and is not as simple: `with_pick` shows it there."""
    if objective == "memory":
        return min(feasible, key=lambda c: (c.device_total, -c.samples_per_second, _simplicity(c.recipe)))
    top = max(c.samples_per_second for c in feasible)
    near = [c for c in feasible if c.samples_per_second >= top * (1 - max(speed_error, SPEED_TIE))]
    least = min(c.device_total_high for c in near)
    roomy = [c for c in near if c.device_total_high <= least + HEADROOM_STEP * limit]
    return min(roomy, key=lambda c: (_simplicity(c.recipe), -c.samples_per_second))


def with_pick(front: list[Candidate], best: Candidate) -> list[Candidate]:
    """The Pareto front as the plan shows it: with its pick, where a recipe at least as fast with a little less memory
    left it off (`choose`), in the front's order (device total)."""
    if best in front:
        return front
    return sorted([*front, best], key=lambda c: (c.device_total, -c.samples_per_second))


def smallest_fitting_gpu(need_bytes: int, margin: float, gpu: GPU) -> GPU | None:
    """The catalog GPU with the least memory that would hold `need_bytes` (context size adjusted)."""
    fitting = [
        g for g in catalog().values()
        if need_bytes - gpu.cuda_context_bytes + g.cuda_context_bytes <= g.memory_bytes * (1 - margin)
    ]
    return min(fitting, key=lambda g: g.memory_bytes, default=None)
