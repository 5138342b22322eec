"""Why each method was or was not chosen, computed from the predictions.

For each axis (fine-tuning method when LoRA/QLoRA are searched, batch size, checkpointing,
precision, optimizer, attention, torch.compile, sharding) the top pick is compared with the same recipe with only that axis changed: does
the alternative fit, how much faster or slower is it predicted to be, how much memory does it
need. Nothing here is canned text about a method; every number comes from a prediction.
"""

from __future__ import annotations

from collections.abc import Callable

from anatomist.anatomy import GIB, MIB
from anatomist.axes.optimizers import runs_with
from anatomist.axes.precisions import precision
from anatomist.axes.shardings import UNSHARDED, ShardingSpec, shardings_for
from anatomist.estimate.traces import prefetch
from anatomist.hardware import GPU
from anatomist.plan.candidates import HEADROOM_STEP, SPEED_TIE, Candidate, Evaluator, smallest_fitting_gpu
from anatomist.plan.space import (
    BF16_WEIGHTS_TRADE_OFF,
    METHODS,
    PEFT_TRADE_OFF,
    SearchSpace,
    checkpointing_alternatives,
    context_parallel_sizes,
    expert_parallel_sizes,
    method_of,
    searched_precisions,
    sequence_parallel_sizes,
    tensor_parallel_fsdp,
    tensor_parallel_sizes,
    valid,
)
from anatomist.recipe import ResolvedRecipe
from anatomist.recipe.axis_values import precision_of, sharding_of
from anatomist.recipe_labels import differing
from anatomist.recipe_labels import label as recipe_label
from anatomist.workload import Workload

Alternatives = Callable[[ResolvedRecipe], list[tuple[str, ResolvedRecipe]]]


def _gib(n: int) -> str:
    """GiB (2**30), or MiB (2**20) below 1 GiB so that small models still read."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


def _compare(best: Candidate, alt_label: str, alt: Candidate, limit: int) -> str:
    speed = alt.samples_per_second / best.samples_per_second - 1
    memory = alt.device_total - best.device_total
    if abs(speed) < SPEED_TIE:
        speed_txt = "same predicted speed"
    else:
        speed_txt = f"{abs(speed):.0%} {'faster' if speed > 0 else 'slower'}"
    mem_txt = f"{'+' if memory >= 0 else '-'}{_gib(abs(memory))}"
    if not alt.fits:
        return f"{alt_label} would not fit ({_gib(alt.device_total)}, up to {_gib(alt.device_total_high)} > limit " \
               f"{_gib(limit)}; {speed_txt})"
    return f"{alt_label}: {speed_txt}, {mem_txt}"


def _if_valid(label: str, recipe: ResolvedRecipe, **changes: object) -> list[tuple[str, ResolvedRecipe]]:
    """[(label, `recipe` with `changes`)], or [] where the changes make a recipe anatomist refuses (fp32 weights or
    Liger beside Cut Cross-Entropy, an offload under tensor parallel): no alternative to compare."""
    return [(label, r) for r in valid(recipe, **changes)]


def _group_batch(recipe: ResolvedRecipe, space: SearchSpace, tp_size: int) -> dict[str, int]:
    """The batch pair of `recipe` for groups of `tp_size` GPUs (1: each GPU its own batch) at the same global batch:
    its per-device batch where the groups' share allows it, else the largest that does."""
    options = space.batch_options(tp_size)
    b = recipe.per_device_train_batch_size
    batch, accumulation = max((o for o in options if o[0] <= b), default=options[0], key=lambda o: o[0])
    return {"per_device_train_batch_size": batch, "gradient_accumulation_steps": accumulation}


def _with_batch(name: str, alternative: ResolvedRecipe, recipe: ResolvedRecipe) -> str:
    """`name`, and the alternative's batch pair where it is not `recipe`'s (another tensor parallel group size)."""
    pair = (alternative.per_device_train_batch_size, alternative.gradient_accumulation_steps)
    same = pair == (recipe.per_device_train_batch_size, recipe.gradient_accumulation_steps)
    return name if same else f"{name} at {pair[0]} x {pair[1]}"


def _sharding_alternatives(r: ResolvedRecipe, space: SearchSpace, workload: Workload) -> list[tuple[str, ResolvedRecipe]]:
    """The other shardings; for a tensor or context parallel pick also the other group sizes, each at the same global
    batch (`_group_batch`); for an expert parallel one the other degrees."""
    alts = [(_with_batch(name, v, r), v) for spec in space.sharding_options(method_of(r))
            if spec.name != sharding_of(r, space.num_gpus) and runs_with(r.optim, spec.fsdp)
            for name, v in _if_valid(spec.name, r, **{**UNSHARDED, **spec.fields, **_group_batch(r, space, 1)})]
    if r.ep_size > 1:
        alts += [(sharding_of(v, space.num_gpus), v) for size in expert_parallel_sizes(space, workload)
                 if size != r.ep_size for v in valid(r, ep_size=size)]
    if r.cp_size > 1:
        alts += [(_with_batch(sharding_of(v, space.num_gpus), v, r), v) for size in context_parallel_sizes(space, workload)
                 if size != r.cp_size for v in valid(r, cp_size=size, **_group_batch(r, space, size))]
    if r.sp_size > 1:
        alts += [(_with_batch(sharding_of(v, space.num_gpus), v, r), v) for size in sequence_parallel_sizes(space, workload)
                 if size != r.sp_size for v in valid(r, sp_size=size, **_group_batch(r, space, size))]
    if r.tp_size == 1:
        return alts
    for size in tensor_parallel_sizes(space, workload):
        fields = {**UNSHARDED, "fsdp": tensor_parallel_fsdp(space, size), "tp_size": size}
        if size != r.tp_size:
            alts += [(_with_batch(sharding_of(v, space.num_gpus), v, r), v)
                     for v in valid(r, **fields, **_group_batch(r, space, size))]
    return alts


def _axes(space: SearchSpace, gpu: GPU, workload: Workload) -> list[tuple[str, Callable[[ResolvedRecipe], str],
                                                                      Alternatives]]:

    def method_alts(r: ResolvedRecipe) -> list[tuple[str, ResolvedRecipe]]:
        """The other methods, at their own precision nearest to `r`'s (QLoRA has one)."""
        alts = []
        for m in space.methods:
            if m == method_of(r):
                continue
            precisions = searched_precisions(space, gpu, m)
            name = precision_of(r) if precision_of(r) in precisions else precisions[-1]
            alts += _if_valid(m, r, **{**METHODS[m], **precision(name).fields})
        return alts

    def batch_alts(r: ResolvedRecipe) -> list[tuple[str, ResolvedRecipe]]:
        return [
            (f"batch {b} x {a}", r.replace(per_device_train_batch_size=b, gradient_accumulation_steps=a))
            for b, a in space.batch_options(r.tp_size * r.sequence_parts)
            if b != r.per_device_train_batch_size
        ]

    # a model without SDPA (transformers' default is eager there) has no fused attention to compare with
    sdpa = workload.default_attention() == "sdpa"
    attn = ["eager"] + (["sdpa"] + (["flash_attention_2"] if float(gpu.compute_capability) >= 8.0 else []) if sdpa else [])
    return [
        ("fine-tuning", method_of, method_alts),
        ("per-device batch x accumulation",
         lambda r: f"{r.per_device_train_batch_size} x {r.gradient_accumulation_steps}", batch_alts),
        ("gradient checkpointing", lambda r: r.checkpointing, lambda r: checkpointing_alternatives(r, space)),
        ("precision", precision_of,
         lambda r: [alt for p in searched_precisions(space, gpu, method_of(r)) if p != precision_of(r)
                    for alt in _if_valid(p, r, **precision(p).fields)]),
        ("optimizer", lambda r: r.optim,
         lambda r: [alt for o in space.optims if o != r.optim and runs_with(o, r.fsdp) for alt in _if_valid(o, r, optim=o)]),
        ("attention", lambda r: r.attn_implementation,
         lambda r: [alt for a in attn if a != r.attn_implementation and (a != "flash_attention_2" or r.mixed_precision != "no")
                    for alt in _if_valid(a, r, attn_implementation=a)]  # context parallel: SDPA's only
         if not r.padding_free else []),  # padding-free rows need the varlen kernel
        ("torch.compile", lambda r: "on" if r.torch_compile else "off",
         lambda r: _if_valid("on" if not r.torch_compile else "off", r, torch_compile=not r.torch_compile)
         if len(space.compile_options) > 1 and not r.use_liger_kernel else []),  # compile over Liger: not traced

        ("sharding", lambda r: sharding_of(r, space.num_gpus), lambda r: _sharding_alternatives(r, space, workload)),
        ("Liger Kernel", lambda r: "on" if r.use_liger_kernel else "off",
         lambda r: _if_valid("on" if not r.use_liger_kernel else "off", r, use_liger_kernel=not r.use_liger_kernel)
         if len(space.liger_options or ()) > 1 and not r.torch_compile else []),
    ]


def explain(best: Candidate, evaluate: Evaluator, space: SearchSpace, objective: str, limit: int, *,
            speed_error: float = SPEED_TIE) -> list[str]:
    """One line per axis: the chosen value, why, and what each alternative would do. An alternative that fits and is
    predicted faster, but by less than `speed_error` (`candidates.speed_error`), was passed over by `choose` for
    headroom or simplicity: the line says which."""
    reasons = []
    goal = "fastest" if objective == "throughput" else "smallest"
    axes = [(axis, label, alternatives(best.recipe)) for axis, label, alternatives in _axes(space, evaluate.gpu, evaluate.workload)]
    every_alternative = [recipe for _, _, named in axes for _, recipe in named]
    prefetch(evaluate.workload, every_alternative, evaluate.gpu.compute_capability,  # traced side by side
             num_gpus=evaluate.num_gpus)
    for axis, label, named in axes:
        alts = [(name, evaluate(recipe)) for name, recipe in named]
        if not alts:
            continue
        fitting = [(n, c) for n, c in alts if c.fits]
        faster_blocked = [n for n, c in alts if not c.fits and c.samples_per_second > best.samples_per_second * (1 + SPEED_TIE)]
        tied = [n for n, c in fitting if abs(c.samples_per_second / best.samples_per_second - 1) < SPEED_TIE]
        passed = [(n, c) for n, c in fitting if c.samples_per_second >= best.samples_per_second * (1 + SPEED_TIE)]
        if objective == "throughput" and passed:
            why = _passed_over(best, *max(passed, key=lambda a: a[1].samples_per_second), speed_error, limit)
        elif objective == "throughput" and tied:
            why = f"ties on predicted speed with {', '.join(tied)}; chosen as the simpler"
        elif faster_blocked and not any(c.samples_per_second > best.samples_per_second for _, c in fitting):
            verb = "does" if len(faster_blocked) == 1 else "do"
            why = f"{goal} that fits ({', '.join(faster_blocked)} would be faster but {verb} not fit)"
        else:
            why = f"{goal} of the options that fit"
        # Keep the lines readable: the three alternatives nearest in speed are shown.
        shown = sorted(alts, key=lambda a: abs(a[1].samples_per_second - best.samples_per_second))[:3]
        details = "; ".join(_compare(best, n, c, limit) for n, c in shown)
        reasons.append(f"{axis} {label(best.recipe)}: {why}. {details}")
    if precision_of(best.recipe) == "bf16-weights":
        reasons.append(BF16_WEIGHTS_TRADE_OFF)
    if best.recipe.peft != "none":
        method = {"lora": "LoRA", "qlora": "QLoRA"}[method_of(best.recipe)]
        reasons.append(PEFT_TRADE_OFF.format(method=method, r=best.recipe.lora_r))
    return reasons


def _passed_over(best: Candidate, name: str, faster: Candidate, speed_error: float, limit: int) -> str:
    """Why `choose` kept `best` over `faster`, an alternative predicted faster within `speed_error`: more headroom at
    the top of its memory interval (by at least HEADROOM_STEP of `limit`), else simplicity. Beyond the error `choose`
    would have taken it, so it was no candidate: the alternatives of an axis are made from the pick, and can be
    combinations the search did not enumerate; said as such."""
    behind = 1 - best.samples_per_second / faster.samples_per_second  # as `choose` measures the tie
    if behind > max(speed_error, SPEED_TIE):  # `choose` would have taken it: an alternative the search did not try
        return (f"{name} is predicted {behind:.0%} faster than the pick ({faster.samples_per_second:.1f} samples/s), "
                "beyond the time error, and fits: a combination the search did not try (plan with it fixed, or "
                "estimate it)")
    said = f"the pick is {behind:.0%} slower predicted than {name}, inside the +-{speed_error:.0%} time error"
    roomier = faster.device_total_high - best.device_total_high
    if roomier >= HEADROOM_STEP * limit:
        return f"{said}: the pick keeps {_gib(roomier)} more headroom (up to {_gib(best.device_total_high)} of " \
               f"{_gib(limit)})"
    return f"{said}: chosen as the simpler"


def most_sharded(space: SearchSpace, adapters: bool) -> ShardingSpec | None:
    """The sharding over several devices that keeps the least on each, of those `space` may search (`--shardings`) for
    what is trained: the one "would fit on N GPUs" names; None where it allows none that shards."""
    allowed = [spec for name, spec in shardings_for(2).items()
               if (space.shardings is None or name in space.shardings) and (spec.for_adapters or not adapters)]
    best = max(allowed, key=lambda spec: (spec.stage, spec.offload), default=None)
    return best if best is not None and best.stage > 0 else None


def explain_infeasible(
    workload: Workload, gpu: GPU, space: SearchSpace, candidates: list[Candidate], limit: int, margin: float
) -> str:
    """Why nothing fits at the top of its memory interval: the smallest recipe's need there, the shortfall, and what
    would fit."""
    smallest = min(candidates, key=lambda c: c.device_total_high)
    need = smallest.device_total_high
    options = []
    larger = smallest_fitting_gpu(need, margin, gpu)
    if larger is not None:
        options.append(f"a GPU with more memory ({larger.name}, {_gib(larger.memory_bytes)})")
    from anatomist.estimate.memory import estimate_memory

    spec = most_sharded(space, adapters=smallest.recipe.peft != "none")
    if spec is not None:
        sharded = smallest.recipe.replace(**{**UNSHARDED, **spec.fields}).resolved(workload)
        for n in (2, 4, 8, 16, 32, 64):
            total = estimate_memory(workload, sharded, gpu, num_gpus=n).interval.high
            if total <= limit:
                named = f"ZeRO-{spec.stage}" + (" + CPU offload" if spec.offload else "") \
                    if spec.engine == "deepspeed" else spec.description.split(":")[0]
                options.append(f"{n} GPUs with {named} (up to {_gib(round(total))} per device; --gpus {n} "
                               f"--shardings {spec.name})")
                break
    offloads = space.shardings is None or "zero2+offload" in space.shardings
    if space.num_gpus == 1 and offloads and not any(c.recipe.offload != "none" for c in candidates):
        options.append("ZeRO offload (zero_stage 2/3 with offload cpu)")
    what = smallest.memory.anatomy
    return (
        f"no recipe fits {gpu.name}: the smallest of {len(candidates)} "
        f"({recipe_label(smallest.recipe, differing([smallest.recipe], space.num_gpus), space.num_gpus)}) "
        f"needs {_gib(smallest.device_total)}, up to "
        f"{_gib(need)} at the top of its interval "
        f"(weights {_gib(what.weights)}, optimizer {_gib(what.optimizer_states)}, gradients {_gib(what.gradients)}, "
        f"activations {_gib(what.activations)}) but the limit is {_gib(limit)} "
        f"({_gib(gpu.memory_bytes)} less the {margin * 100:.3g}% margin): short by {_gib(need - limit)}. "
        f"Would fit: {'; '.join(options) if options else 'nothing anatomist can model'}"
    )
