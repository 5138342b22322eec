"""Which experts kernel a Mixture-of-Experts model runs, and which ones a trace without data can follow.

transformers 5 runs the experts of the models it decorates with `use_experts_implementation` (Mixtral,
Qwen2/3-MoE, DeepSeek-V2/V3, gpt-oss, OLMoE, ...) through the kernel `from_pretrained(experts_implementation=...)`
names (`transformers.integrations.moe`); models it does not decorate (Llama 4, JetMoE, ...) run their own code.

- grouped_mm, the default: the T x k (token, expert) pairs of T tokens and a top-k router are sorted by expert
  and go through grouped matrix products over all T x k rows; the per-expert counts (`offs`) only say where each
  group starts. Every tensor has T x k (or T) rows whatever the router picks.
- batched_mm: gathers every pair's expert weights ([T x k, 2 x intermediate, hidden]) and runs batched products:
  T x k rows too, whatever the routing (meant for decoding a few tokens: in training the weight copies are huge).
- eager: a loop over the experts the router picked, each taking its tokens with `torch.where` on the choice:
  tensor sizes follow the data, which a fake tensor does not have. Refused, with one line.

A trace succeeds only where no tensor's size depends on the values (fake tensors raise otherwise), so a traced
MoE step keeps the same tensors for every routing: see `estimate.moe`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from anatomist.errors import InputError
from anatomist.recipe import ResolvedRecipe
from anatomist.workload import Workload

MODELLED = ("grouped_mm", "batched_mm")
"""The experts kernels whose step a trace follows (sizes independent of the routing)."""
OWN_CODE = "the model's own code"
"""What `experts_kernel` names for MoE models that transformers' kernels do not serve."""


def experts_kernel(workload: Workload, recipe: ResolvedRecipe) -> str | None:
    """The experts kernel `workload`'s model runs under `recipe`: an `experts_implementation` name,
    OWN_CODE where its class takes none, None for a dense model."""
    if not workload.is_moe:
        return None
    if workload.task not in workload.facts.kernel_tasks:
        return OWN_CODE
    return recipe.experts_implementation


def build_kwargs(workload: Workload, recipe: ResolvedRecipe) -> dict[str, Any]:
    """What `from_pretrained` / `from_config` is given for the recipe's experts kernel: nothing for
    grouped_mm (transformers' default, which a model without kernels must not be asked for by name)."""
    if recipe.experts_implementation == "grouped_mm" or not workload.is_moe:
        return {}
    return {"experts_implementation": recipe.experts_implementation}


def check_traceable(workload: Workload, recipe: ResolvedRecipe) -> None:
    """Refuse, before tracing, the experts kernels whose sizes follow the data.

    Raises:
        InputError: experts_implementation eager on a Mixture-of-Experts model, or a config that names
            an experts kernel other than the recipe's (transformers would run the config's).
    """
    if not workload.is_moe:
        return
    named = workload.facts.experts_implementation
    if named is not None and named != recipe.experts_implementation:
        raise InputError(
            f"{workload.name}: its config sets experts_implementation={named!r} but the recipe models "
            f"{recipe.experts_implementation!r}: pass --experts-implementation {named} (modelled: "
            f"{', '.join(MODELLED)}) or remove it from the config"
        )
    if experts_kernel(workload, recipe) == "eager":
        raise InputError(
            f"{workload.name}: experts_implementation='eager' loops over the experts the router picked, with "
            f"tensor sizes that follow the data, which an estimate without data cannot know; modelled: "
            f"{', '.join(MODELLED)} (grouped_mm is transformers' default)"
        )


@contextlib.contextmanager
def compiled_experts_path() -> Iterator[None]:
    """Within: transformers' grouped_mm takes the path it takes under torch.compile. `_can_use_grouped_mm` refuses
    torch's grouped product there for weights other than bf16 (inductor lowers it for bf16 only) and runs its own
    fallback, the custom op `transformers::grouped_mm_fallback` (one mm per expert, opaque to inductor; its backward
    makes the input's and the weight's gradients). The compiled blocks' trace (trace/step/compiled.py) runs no dynamo,
    so it is told what dynamo's tracing would say."""
    import torch
    from transformers.integrations import moe

    original = moe._can_use_grouped_mm

    def as_when_compiling(input: Any, weight: Any, offs: Any) -> bool:
        return weight.dtype == torch.bfloat16 and original(input, weight, offs)

    moe._can_use_grouped_mm = as_when_compiling
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


def split_sizes(tokens: int, top_k: int, experts: int, ep_size: int, routing: str) -> tuple[list[int], list[int]]:
    """The rows the traced rank (rank 0 of its expert parallel group) sends to and receives from each rank of the group
    under `routing` (axes/shardings.py EpRouting), `tokens` tokens a rank of top-`top_k` routing over `experts`:
    - balanced: its `tokens` x `top_k` (token, expert) pairs spread evenly over the group's ranks, and as many from
      each rank to it;
    - skewed: every token of every rank picks as many of rank 0's experts as it can (top-k picks an expert at most
      once: min(top_k, experts / ep_size) of them) and sends its other pairs evenly to the other ranks."""
    pairs = tokens * top_k
    if routing == "balanced":
        return _spread(pairs, ep_size), _spread(pairs, ep_size)
    mine = tokens * min(top_k, experts // ep_size)
    return [mine, *_spread(pairs - mine, ep_size - 1)], [mine] * ep_size


def received_rows(tokens: int, top_k: int, experts: int, ep_size: int) -> tuple[int, int]:
    """The rows the traced rank's experts run under balanced and under skewed routing (`split_sizes`)."""
    balanced, skewed = (sum(split_sizes(tokens, top_k, experts, ep_size, r)[1]) for r in ("balanced", "skewed"))
    return balanced, skewed


def _spread(total: int, parts: int) -> list[int]:
    """`total` in `parts` as even as whole numbers allow, the larger first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


@contextlib.contextmanager
def routed_as(workload: Workload, recipe: ResolvedRecipe) -> Iterator[None]:
    """Within: transformers' expert parallel dispatch (`AllToAllEP._dispatch_tokens`, distributed/expert_parallel.py)
    runs as written, but the split sizes it reads back from the exchanged counts (`.tolist()`, the one host sync of
    the layer: a fake tensor has no values) are those `recipe.ep_routing` gives (`split_sizes`). Every other tensor
    of the exchange (the sorted rows it sends, the rows it receives, their expert ids) is transformers'. Nothing
    without expert parallel."""
    if recipe.ep_size == 1 or workload.facts.experts is None:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers.distributed import expert_parallel

    top_k, experts = workload.facts.experts
    original, tolist = expert_parallel.AllToAllEP._dispatch_tokens, FakeTensor.tolist

    def dispatch(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        sizes = split_sizes(hidden_states.shape[0], top_k, experts, recipe.ep_size, recipe.ep_routing)

        def read_back(tensor: Any) -> Any:
            if tuple(tensor.shape) != (2, recipe.ep_size):
                raise RuntimeError(f"expert parallel's dispatch read back a {tuple(tensor.shape)} tensor where "
                                   f"transformers' reads its (2, {recipe.ep_size}) split sizes: its code changed")
            return [list(s) for s in sizes]

        setattr(FakeTensor, "tolist", read_back)  # noqa: B010 (a method, replaced for the one call)
        try:
            return original(self, hidden_states, top_k_index, top_k_weights)
        finally:
            setattr(FakeTensor, "tolist", tolist)  # noqa: B010

    setattr(expert_parallel.AllToAllEP, "_dispatch_tokens", dispatch)  # noqa: B010 (a method, replaced)
    try:
        yield
    finally:
        setattr(expert_parallel.AllToAllEP, "_dispatch_tokens", original)  # noqa: B010
