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
