"""The splits the plan tries beyond data parallel: tensor parallel (`tensor_parallel_variants`) and, for a Mixture of
Experts, expert parallel (`expert_parallel_variants`), both set where transformers loads the model, and for a causal
LM's long sequences context parallel under FSDP and DeepSpeed's sequence parallel under ZeRO
(`context_parallel_variants`, `sequence_parallel_variants`: accelerate's ParallelismConfig), each only where it could
help, and the notes that say what was tried. `search._with_variants` runs them after the base recipes'
checkpointing variants, and the split recipes' own checkpointing after them."""

from __future__ import annotations

from collections.abc import Callable

from anatomist.plan.candidates import SPEED_TIE, Candidate, Evaluator, Objective
from anatomist.plan.space import (
    SearchSpace,
    context_parallel_sizes,
    expert_parallel_sizes,
    sequence_parallel_sizes,
    tensor_parallel_fsdp,
    tensor_parallel_sizes,
    valid,
)
from anatomist.recipe import ResolvedRecipe
from anatomist.workload import Workload


def tensor_parallel_variants(recipes: list[ResolvedRecipe], best: Candidate | None, evaluate: Evaluator,
                             objective: Objective, space: SearchSpace) -> list[ResolvedRecipe]:
    """Tensor parallel versions (groups of `tensor_parallel_sizes`) of the searched recipes that do not fit and would beat
    `best`, or of every one where nothing fits or the objective is memory: the same settings split over groups of T
    GPUs (transformers' tp_plan; under FSDP's full_shard where the GPUs are more than a group, else alone), each
    group one batch, so the batch pairs are a group's (`SearchSpace.batch_options`).

    Whether one would beat `best` is asked of the same recipe without tensor parallel, less the collectives its
    compute does not hide: splitting leaves each GPU 1/T of the products but all of the norms and the loss, and adds
    its own collectives, for 1/T of the batches; what it can save is data parallel traffic, T times smaller. So it
    is never predicted faster than that bound, which saves tracing the groups where they cannot win."""
    sizes = tensor_parallel_sizes(space, evaluate.workload)
    if not sizes:
        return []

    def worth_splitting(r: ResolvedRecipe) -> bool:
        if objective == "memory" or best is None:
            return True
        return (_could_win_without_communication(r, best, evaluate)
                and not evaluate(r).fits)  # memory last: `fastest_fitting` has not predicted every recipe's

    variants = []
    for size in sizes:
        for r in recipes:
            if r.tp_size == 1 and r.fsdp == tensor_parallel_fsdp(space, size) and not r.zero_stage and worth_splitting(r):
                variants += [v.resolved(evaluate.workload) for b, a in space.batch_options(size) for v in
                             valid(r, tp_size=size, per_device_train_batch_size=b, gradient_accumulation_steps=a)]
    return list(dict.fromkeys(variants))


def expert_parallel_variants(recipes: list[ResolvedRecipe], best: Candidate | None, evaluate: Evaluator,
                             objective: Objective, space: SearchSpace) -> list[ResolvedRecipe]:
    """For a Mixture of Experts on several GPUs: the FSDP full_shard recipes with their experts spread over 2, 4 ...
    GPUs (`expert_parallel_sizes`), each GPU its own batch, where it could help: a recipe that does not fit (no
    expert is then gathered whole), or one whose exposed communication, all of it removed, would beat `best` (what
    expert parallel can save is FSDP's traffic of the experts; its all-to-alls are added, never hidden). Judged at
    balanced routing, as every estimate's figure is."""
    sizes = expert_parallel_sizes(space, evaluate.workload)
    if not sizes:
        return []

    def worth_splitting(r: ResolvedRecipe) -> bool:
        if objective == "memory" or best is None or not evaluate(r).fits:
            return True
        return _could_win_without_communication(r, best, evaluate)

    variants = []
    for r in recipes:
        if r.fsdp == "full_shard" and not r.split_by_transformers and r.dp_replicate_size == 1 and worth_splitting(r):
            variants += [v.resolved(evaluate.workload) for size in sizes for v in valid(r, ep_size=size)]
    return list(dict.fromkeys(variants))


def context_parallel_variants(recipes: list[ResolvedRecipe], best: Candidate | None, evaluate: Evaluator,
                              objective: Objective, space: SearchSpace) -> list[ResolvedRecipe]:
    """The FSDP full_shard recipes of a causal LM that do not fit (or every one where nothing fits or the objective is
    memory), HSDP's among them, with each sequence split over groups of C GPUs (`context_parallel_sizes`), each group
    one batch, so the batch pairs are a group's. Only those: context parallel saves activations, not time (a GPU computes its part of
    every layer for 1/C of the batches and adds the ring's exchanges)."""
    return _split_sequences(recipes, best, evaluate, objective, space, "cp_size",
                            context_parallel_sizes(space, evaluate.workload),
                            lambda r: r.fsdp == "full_shard" and not r.split_by_transformers and r.sequence_parts == 1)


def sequence_parallel_variants(recipes: list[ResolvedRecipe], best: Candidate | None, evaluate: Evaluator,
                               objective: Objective, space: SearchSpace) -> list[ResolvedRecipe]:
    """The same for the DeepSpeed ZeRO recipes, with DeepSpeed's Ulysses over groups of P GPUs
    (`sequence_parallel_sizes`)."""
    return _split_sequences(recipes, best, evaluate, objective, space, "sp_size",
                            sequence_parallel_sizes(space, evaluate.workload),
                            lambda r: r.zero_stage > 0 and r.sequence_parts == 1)


def _split_sequences(recipes: list[ResolvedRecipe], best: Candidate | None, evaluate: Evaluator, objective: Objective,
                     space: SearchSpace, field: str, sizes: list[int],
                     takes: Callable[[ResolvedRecipe], bool]) -> list[ResolvedRecipe]:
    """The recipes `takes` accepts that do not fit (every one where nothing fits or the objective is memory), with
    `field` (cp_size, sp_size) at each of `sizes`, the batch pairs a group's."""
    if not sizes:
        return []

    def worth_splitting(r: ResolvedRecipe) -> bool:
        return objective == "memory" or best is None or not evaluate(r).fits

    variants = []
    for r in recipes:
        if takes(r) and worth_splitting(r):
            variants += [v.resolved(evaluate.workload) for size in sizes for b, a in space.batch_options(size) for v in
                         valid(r, **{field: size}, per_device_train_batch_size=b, gradient_accumulation_steps=a)]
    return list(dict.fromkeys(variants))


def context_parallel_note(space: SearchSpace, workload: Workload, candidates: list[Candidate]) -> list[str]:
    """Whether context parallel was tried (`context_parallel_variants`), over how many GPUs, on how many recipes."""
    return _tried(context_parallel_sizes(space, workload), sum(c.recipe.cp_size > 1 for c in candidates),
                  "context parallel: tried over {sizes} GPUs on the FSDP recipes that do not fit ({tried}); "
                  "--no-tensor-parallel leaves it out", "none: every FSDP recipe that could take it fitted")


def sequence_parallel_note(space: SearchSpace, workload: Workload, candidates: list[Candidate]) -> list[str]:
    """Whether DeepSpeed's sequence parallel was tried (`sequence_parallel_variants`), over how many GPUs, on how many
    recipes."""
    return _tried(sequence_parallel_sizes(space, workload), sum(c.recipe.sp_size > 1 for c in candidates),
                  "sequence parallel (DeepSpeed's Ulysses): tried over {sizes} GPUs on the ZeRO recipes that do not fit "
                  "({tried}); --no-tensor-parallel leaves it out", "none: every ZeRO recipe that could take it fitted")


def _tried(sizes: list[int], split: int, line: str, none: str, counted: str = "recipe(s) predicted") -> list[str]:
    """A split's note: `line` with the sizes tried and how many recipes were split (`none`'s words for none); nothing
    where no size was tried."""
    if not sizes:
        return []
    return [line.format(sizes=", ".join(map(str, sizes)), tried=f"{split} {counted}" if split else none)]


def _could_win_without_communication(r: ResolvedRecipe, best: Candidate, evaluate: Evaluator) -> bool:
    """Whether `r`, less the communication its compute does not hide, would beat `best`: the bound on what splitting
    it (tensor or expert parallel) can gain, whose saving is data parallel traffic."""
    time = evaluate.time(r)
    bound = time.samples_per_second * time.step_s / (time.step_s - time.phases_s.get("communication", 0.0))
    return bound > best.samples_per_second * (1 + SPEED_TIE)


def tensor_parallel_note(space: SearchSpace, workload: Workload, candidates: list[Candidate]) -> list[str]:
    """Whether tensor parallel was tried (`tensor_parallel_variants`), in which group sizes, on how many recipes."""
    return _tried(tensor_parallel_sizes(space, workload), sum(c.recipe.tp_size > 1 for c in candidates),
                  "tensor parallel: tried in groups of {sizes} on the recipes that do not fit and could win ({tried}); "
                  "--no-tensor-parallel leaves it out", "none split: every recipe fitted or could not win",
                  counted="split recipe(s) predicted")


def expert_parallel_note(space: SearchSpace, workload: Workload, candidates: list[Candidate]) -> list[str]:
    """Whether expert parallel was tried (`expert_parallel_variants`), in which degrees, on how many recipes."""
    return _tried(expert_parallel_sizes(space, workload), sum(c.recipe.ep_size > 1 for c in candidates),
                  "expert parallel: tried over {sizes} GPUs on the FSDP recipes that do not fit or could win ({tried}), "
                  "judged at balanced routing (`anatomist estimate --ep-size E` gives the skewed end); "
                  "--no-tensor-parallel leaves it out", "none: every FSDP recipe fitted and could not win")
