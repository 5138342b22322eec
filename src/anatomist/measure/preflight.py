"""The pre-flight: will this recipe fit, and if not, the smallest change that does.

Shared by `AnatomistCallback(preflight=...)` (a Trainer about to train), `track(preflight=...)`
(a plain or Accelerate loop) and `anatomist check` (a script or a job scheduler). The prediction
is `estimate()`'s; the changes are searched by `plan()` over a space restricted to the user's
recipe, where only what may change varies:

- "fit": the (per-device batch, accumulation) pairs that keep the effective batch
  (per-device x accumulation x devices), everything else as given: the fastest pair that fits;
- "refuse": those pairs first (no new trace, nothing learned changes); where none fits, with
  gradient checkpointing and the plan's optimizers too: among the recipes that fit, the one that
  changes the fewest settings, then the fastest.

Known limitations: the effective batch is kept only with per-device batches the plan searches
(powers of two and multiples of 8 that divide the per-device share, `SearchSpace.batch_options`);
a precision the plan does not search (fp16/bf16 weights with autocast) gets no suggestion.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN, MemoryCategory, Verdict
from anatomist.errors import InputError
from anatomist.hardware import GPU, detect_local_gpu, get_gpu

if TYPE_CHECKING:
    from anatomist.estimate.predict import Estimate
    from anatomist.plan.candidates import Candidate
    from anatomist.plan.space import SearchSpace
    from anatomist.recipe import Recipe
    from anatomist.workload import Workload

PreflightMode = Literal["warn", "refuse", "fit"]
PREFLIGHT_MODES: tuple[str, ...] = get_args(PreflightMode)
"""warn: say what is predicted; refuse: stop before the first step if it will not fit; fit: change the
batch/accumulation pair to one that fits and keeps the effective batch (else as refuse)."""
BATCH_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps")
"""The pair "fit" may change: one change, whichever of the two moves."""
SEARCHED_FIELDS = (BATCH_FIELDS, ("gradient_checkpointing",), ("optim",))
"""What "refuse" may suggest changing, each one change."""


class PreflightRefused(RuntimeError):
    """The pre-flight predicts the run will not fit: raised before the first step, the message says
    the prediction, the limit and the smallest change that fits."""


class BelowWeights(InputError):
    """The memory budget is below the model's weights alone: no batch, accumulation, checkpointing or
    optimizer can help (bad input where the budget was given; under "warn" it is said and the run goes on)."""


def check_mode(mode: str | None) -> PreflightMode | None:
    """`mode` checked (None: no pre-flight).

    Raises:
        InputError: a mode not in PREFLIGHT_MODES.
    """
    if mode is not None and mode not in PREFLIGHT_MODES:
        raise InputError(f"preflight must be one of {', '.join(PREFLIGHT_MODES)} (or None), got {mode!r}")
    return mode  # type: ignore[return-value]


def target_gpu(gpu: str | GPU | None, limit_bytes: int | None,
               margin: float = DEFAULT_MEMORY_MARGIN) -> tuple[GPU, float]:
    """The GPU predicted for and the share of it kept free.

    Args:
        gpu: a catalog name, a GPU, or None: the GPU NVML finds here.
        limit_bytes: an explicit memory budget (a CPU test, a GPU shared with another job): the
            device total must fit in exactly this many bytes (no margin on top); the GPU's rates and
            CUDA context still come from `gpu`.
        margin: share of the GPU's memory kept free when no budget is given.

    Raises:
        InputError: no GPU given and none found here, an unknown GPU name, a budget that is not positive.
    """
    found = get_gpu(gpu) if isinstance(gpu, str) else gpu if gpu is not None else detect_local_gpu()
    if found is None:
        raise InputError("no GPU found through NVML: name the GPU to predict for (--gpu A100-80GB, or gpu=\"A100-80GB\")")
    if limit_bytes is None:
        return found, margin
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
        raise InputError(f"limit_bytes must be a positive integer, got {limit_bytes!r}")
    # the name is kept: the GPU's time calibration is looked up by it
    return replace(found, memory_bytes=limit_bytes), 0.0


@dataclass(kw_only=True, slots=True)
class Preflight:
    """The pre-flight of one recipe: its prediction and, where it does not fit, what would."""

    estimate: Estimate
    """The prediction of the recipe as given."""
    num_gpus: int
    """Data-parallel devices (the Trainer's world size)."""
    change: Candidate | None = None
    """The recipe to run instead (None: it fits as given, or nothing searched fits)."""
    changed: tuple[str, ...] = ()
    """The fields `change` sets differently from the recipe as given."""
    why_not: str | None = None
    """Where nothing searched fits: what the plan says is short."""
    budget_bytes: int | None = None
    """The explicit memory budget the prediction was held to (`target_gpu`'s limit_bytes), if any."""

    @property
    def verdict(self) -> Verdict:
        """fits (even the top of the memory interval), borderline, or does not fit (even its bottom)."""
        return self.estimate.memory.verdict

    @property
    def fits(self) -> bool:
        """Whether it fits at the top of its memory interval: no change is searched."""
        return self.verdict == "fits"

    @property
    def refused(self) -> bool:
        """Whether even the bottom of its memory interval is above the limit: "refuse" stops the run."""
        return self.verdict == "does not fit"

    @property
    def effective_batch(self) -> int:
        r = self.estimate.recipe
        return r.per_device_train_batch_size * r.gradient_accumulation_steps * self.num_gpus

    @property
    def device_total_bytes(self) -> int:
        total = self.estimate.memory.anatomy.device_total
        assert total is not None  # an estimate always has one
        return total

    def to_dict(self) -> dict[str, Any]:
        """What `anatomist check --json` prints: the estimate, the verdict and the change."""
        change = None
        if self.change is not None:
            change = {"recipe": self.change.recipe.to_dict(), "changed": list(self.changed),
                      "device_total": self.change.device_total,
                      "samples_per_second": self.change.samples_per_second}
        return {"fits": self.fits, "verdict": self.verdict, "num_gpus": self.num_gpus, "effective_batch": self.effective_batch,
                "budget_bytes": self.budget_bytes, "estimate": self.estimate.to_dict(), "smallest_change": change,
                "why_not": self.why_not}

    def table(self) -> str:
        """The compact table the log shows: predicted peak, limit, fits, largest batch."""
        e, r = self.estimate, self.estimate.recipe
        rows = [
            ("model", f"{e.workload.name} ({e.memory.parameters / 1e6:,.1f} M parameters), seq {e.workload.seq_len}"),
            ("recipe", f"batch {r.per_device_train_batch_size} x {r.gradient_accumulation_steps} accumulation x "
                       f"{self.num_gpus} device(s) = {self.effective_batch}, weights {r.dtype}, "
                       f"{r.mixed_precision} autocast, {r.optim}, checkpointing {r.checkpointing}"
                       + (f", {r.peft}" if r.peft != "none" else "")),
            ("predicted peak", f"{_size(self.device_total_bytes)} device total, likely {_size(e.memory.interval.low)} "
                               f"to {_size(e.memory.interval.high)} ({_size(e.memory.anatomy.peak_allocated)} "
                               "allocated)"),
            ("limit", f"{_size(e.memory.limit_bytes)} on {e.gpu.name}"
                      + (" (the budget given)" if self.budget_bytes is not None
                         else f" less the {e.margin:.0%} margin" if e.margin else "")),
            ("fits", {"fits": "yes", "borderline": "borderline (the limit is inside the interval)",
                      "does not fit": "no"}[self.verdict]),
            ("largest batch", str(e.memory.max_batch_size)),
        ]
        if self.change is not None:
            rows.append(("fits with", self.describe_change()))
        elif self.why_not:
            rows.append(("nothing fits", self.why_not))
        width = max(len(k) for k, _ in rows)
        return "\n".join(["anatomist pre-flight"] + [f"  {k:<{width}}  {v}" for k, v in rows])

    def describe_change(self) -> str:
        """`field=old -> new, ...` of the change, with its predicted total."""
        assert self.change is not None
        given, new = self.estimate.recipe, self.change.recipe
        parts = [f"{f}={getattr(given, f)} -> {getattr(new, f)}" for f in self.changed]
        return (f"{', '.join(parts)} (predicted {_size(self.change.device_total)}, "
                f"{self.change.samples_per_second:.3g} samples/s; effective batch {self.effective_batch} kept)")

    def refusal(self) -> str:
        """The one message a refused run stops with (or a borderline one warns with)."""
        e, r = self.estimate, self.estimate.recipe
        what = "will not fit" if self.refused else "may not fit"
        head = (f"anatomist pre-flight: {e.workload.name} {what}: predicted device total "
                f"{_size(self.device_total_bytes)} (likely {_size(e.memory.interval.low)} to "
                f"{_size(e.memory.interval.high)}) against the limit {_size(e.memory.limit_bytes)} on {e.gpu.name} at "
                f"per_device_train_batch_size={r.per_device_train_batch_size}, "
                f"gradient_accumulation_steps={r.gradient_accumulation_steps}")
        if self.change is not None:
            return f"{head}; smallest change that fits at the top of its interval: {self.describe_change()}"
        return f"{head}; {self.why_not or 'no change searched fits'}"


def preflight(workload: Workload, recipe: Recipe, gpu: GPU, *, num_gpus: int = 1,
              margin: float = DEFAULT_MEMORY_MARGIN, mode: PreflightMode = "warn",
              budget_bytes: int | None = None) -> Preflight:
    """Predict `recipe`; where it does not fit, search the change `mode` may make (see the module).
    `gpu` and `margin` as `target_gpu` gives them; `budget_bytes`: its limit_bytes, said in the table.

    Raises:
        BelowWeights: the budget is below the weights alone (no batch, accumulation or checkpointing
            can help).
        InputError: what `estimate()` refuses.
    """
    from anatomist.estimate.predict import estimate

    predicted = estimate(workload, recipe, gpu, num_gpus=num_gpus, margin=margin)
    weights = predicted.memory.anatomy.category_bytes(MemoryCategory.WEIGHTS)
    if weights > predicted.memory.limit_bytes:
        raise BelowWeights(f"the memory limit {_size(predicted.memory.limit_bytes)} on {gpu.name} is below "
                         f"{workload.name}'s weights alone ({_size(weights)} predicted)")
    result = Preflight(estimate=predicted, num_gpus=num_gpus, budget_bytes=budget_bytes)
    if result.fits:
        return result
    # The batch pair first: keeping the effective batch, it changes nothing of what is learned, and it
    # needs no new trace; "refuse" then looks at checkpointing and the optimizer too.
    result.change, result.changed, result.why_not = smallest_change(predicted, num_gpus, (BATCH_FIELDS,))
    if result.change is None and mode != "fit":
        result.change, result.changed, result.why_not = smallest_change(predicted, num_gpus, SEARCHED_FIELDS)
    return result


def smallest_change(predicted: Estimate, num_gpus: int, fields: tuple[tuple[str, ...], ...]
                    ) -> tuple[Candidate | None, tuple[str, ...], str | None]:
    """The recipe that fits, keeps the effective batch and changes the fewest of `fields` (each
    tuple one change), then is the fastest: (candidate, the fields it changes, None), or
    (None, (), what the plan says is short) where none of the space fits."""
    from anatomist.plan.search import plan

    space = search_space(predicted.recipe, num_gpus, {f for group in fields for f in group}, predicted.gpu)
    if isinstance(space, str):
        return None, (), space
    try:
        found = plan(predicted.workload, predicted.gpu, space=space, margin=predicted.margin)
    except InputError as exc:
        return None, (), str(exc)
    given = predicted.recipe

    def changes(c: Candidate) -> int:
        return sum(any(getattr(c.recipe, f) != getattr(given, f) for f in group) for group in fields)

    best = min(found.feasible, key=lambda c: (changes(c), -c.samples_per_second))
    changed = tuple(f for group in fields for f in group if getattr(best.recipe, f) != getattr(given, f))
    return best, changed, None


def search_space(recipe: Recipe, num_gpus: int, free: set[str], gpu: GPU) -> SearchSpace | str:
    """The plan's space around `recipe`: the effective batch kept, only the `free` fields varied; or why the plan
    cannot search around it (a precision or sharding it does not search)."""
    from anatomist.axes.optimizers import DEFAULT_SEARCH
    from anatomist.axes.precisions import FULL_PRECISIONS
    from anatomist.axes.shardings import shardings_for
    from anatomist.plan.space import SearchSpace, method_of
    from anatomist.recipe.axis_values import sharding_of

    method = method_of(recipe)
    name = _precision(recipe)
    if method != "qlora" and name not in FULL_PRECISIONS:
        return f"its precision ({name}) is not one the plan searches"
    sharding = sharding_of(recipe, num_gpus)
    if sharding not in shardings_for(num_gpus):
        return f"its sharding ({sharding}) is not one the plan searches on {num_gpus} GPU(s)"
    optims = tuple(dict.fromkeys((recipe.optim, *DEFAULT_SEARCH))) if "optim" in free else (recipe.optim,)
    checkpointing = (recipe.gradient_checkpointing, True) if "gradient_checkpointing" in free else None
    return SearchSpace(
        global_batch_size=recipe.per_device_train_batch_size * recipe.gradient_accumulation_steps * num_gpus,
        num_gpus=num_gpus, optims=optims, compile_options=(recipe.torch_compile,),
        checkpointing_options=tuple(dict.fromkeys(checkpointing or (recipe.gradient_checkpointing,))),
        shardings=(sharding,), precisions=(name,), methods=(method,), base=recipe,
        liger_options=(recipe.use_liger_kernel,),  # held: the plan would otherwise search Liger for causal LMs
        partial_checkpointing=(), offload_checkpoints=False, offload_activations=False,  # held: not the callback's
    )


def _precision(recipe: Recipe) -> str:
    from anatomist.recipe.axis_values import precision_of

    return precision_of(recipe)


def _size(nbytes: int | float) -> str:
    """GiB from 1 GiB up, MiB below (a tiny model's figures on a CPU test)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
