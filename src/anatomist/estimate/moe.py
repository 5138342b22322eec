"""Mixture of Experts: what the estimate assumes of the routing, and how far a real routing can move it.

Routing is data dependent and a fake-tensor trace has no data. What the trace can and cannot follow
is the experts kernel's business (`trace.step.experts`): transformers' grouped_mm (its default) and
batched_mm run every layer's T x k routed rows (T tokens of a micro-batch, a top-k router) whatever the
router picks, and a trace only succeeds where no tensor's size depends on the values. So for every
step that traces, the memory is the same for any routing:

- balanced, as the auxiliary load-balancing loss aims (Shazeer et al. 2017, "Outrageously Large
  Neural Networks", section 4; Fedus et al. 2021, "Switch Transformers", section 2.2): T x k / E rows
  per expert;
- the worst case a user may hit, one expert receiving every token: T rows (a top-k router picks an
  expert at most once per token), the other experts sharing the rest.

Both hold the same tensors (a real CPU step whose router sends every token to the same experts keeps
exactly those of a balanced one: tests/test_moe.py), so the range (`MoeRouting.peak_range_bytes`) has
equal ends and the output says why. What a skewed load does change is time (the busiest expert's
group dominates the grouped product), which the roofline, counting FLOPs that the split does not
change either, does not model.

Expert parallel (`ep_size`) is where the routing does change memory: a GPU holds 1/ep_size of the experts and runs
them on the rows the all-to-all brings it, which the routing decides. Its step is traced at both ends
(`trace.step.experts.routed_as`): balanced (T x k rows in, as many as it sends) and skewed (every token of the group's
ep_size GPUs picking as many of this GPU's experts as top-k allows: ep_size x T x min(k, E / ep_size) rows in).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from anatomist.anatomy import MemoryAnatomy
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.step.experts import OWN_CODE, experts_kernel, received_rows
from anatomist.workload import Workload


@dataclass(frozen=True, slots=True, kw_only=True)
class MoeRouting:
    """The routing an estimate of a Mixture-of-Experts model assumes, per MoE layer and micro-batch."""

    experts_implementation: str
    """The experts kernel modelled (`trace.step.experts.experts_kernel`)."""
    experts: int
    """Routed experts per MoE layer (shared experts, which take every token, not counted)."""
    experts_per_token: int
    tokens: int
    """Tokens of one micro-batch on one device: batch x sequence length."""
    peak_range_bytes: tuple[int, int]
    """Peak allocated bytes from balanced routing to one expert receiving every token (equal: see the module); under
    expert parallel, from balanced to skewed (`trace.step.experts.split_sizes`)."""
    ep_size: int = 1

    @property
    def routed_rows(self) -> int:
        """(token, expert) pairs: the rows the experts kernel runs."""
        return self.tokens * self.experts_per_token

    @property
    def balanced_tokens_per_expert(self) -> float:
        return self.routed_rows / self.experts

    @property
    def max_tokens_per_expert(self) -> int:
        """Every token once: what one expert receives at worst (under expert parallel, every token of its group)."""
        return self.tokens * self.ep_size

    @property
    def received_rows_range(self) -> tuple[int, int]:
        """Under expert parallel, the rows a GPU's experts run: balanced, then skewed (`received_rows`)."""
        return received_rows(self.tokens, self.experts_per_token, self.experts, self.ep_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "experts_implementation": self.experts_implementation,
            "experts": self.experts,
            "experts_per_token": self.experts_per_token,
            "tokens": self.tokens,
            "routed_rows": self.routed_rows,
            "balanced_tokens_per_expert": self.balanced_tokens_per_expert,
            "max_tokens_per_expert": self.max_tokens_per_expert,
            "peak_range_bytes": list(self.peak_range_bytes),
            "ep_size": self.ep_size,
            **({"received_rows_range": list(self.received_rows_range)} if self.ep_size > 1 else {}),
        }


def moe_routing(workload: Workload, recipe: ResolvedRecipe, anatomy: MemoryAnatomy,
                other_end: Callable[[ResolvedRecipe], int] | None = None) -> MoeRouting | None:
    """The routing assumption and peak range of an estimate (None for a dense model); under expert parallel the
    other end of the range is `other_end`'s peak of the recipe at the other routing."""
    counts = workload.facts.experts
    kernel = experts_kernel(workload, recipe)
    if counts is None or kernel is None:
        return None
    per_token, experts = counts
    ends = {"balanced": anatomy.peak_allocated, "skewed": anatomy.peak_allocated}
    if recipe.ep_size > 1 and other_end is not None:
        other = "skewed" if recipe.ep_routing == "balanced" else "balanced"
        ends[other] = other_end(recipe.replace(ep_routing=other))
    return MoeRouting(
        experts_implementation=kernel, experts=experts, experts_per_token=per_token,
        tokens=recipe.per_device_train_batch_size * workload.seq_len,
        peak_range_bytes=(ends["balanced"], ends["skewed"]), ep_size=recipe.ep_size,
    )


def moe_note(workload: Workload, recipe: ResolvedRecipe) -> str | None:
    """What the notes say of a Mixture-of-Experts estimate: the routing assumed and why any other gives the
    same memory (None for a dense model)."""
    counts = workload.facts.experts
    kernel = experts_kernel(workload, recipe)
    if counts is None or kernel is None:
        return None
    per_token, experts = counts
    tokens = recipe.per_device_train_batch_size * workload.seq_len
    rows = tokens * per_token
    kept = "all experts' weights are kept" + (" (and trained)" if recipe.peft == "none" else "")
    if kernel == OWN_CODE:
        return (f"Mixture of Experts: {kept}; the experts run {kernel} (not one of transformers' experts kernels), "
                "traced as written: its tensor sizes do not depend on the routing, or the trace would have failed")
    if recipe.ep_size > 1:
        balanced, skewed = received_rows(tokens, per_token, experts, recipe.ep_size)
        return (f"Mixture of Experts, expert parallel over {recipe.ep_size} GPUs: each holds {experts // recipe.ep_size} "
                f"of the {experts} experts of each layer and runs them on the rows an all-to-all brings it, {balanced:,} "
                f"routed rows per layer when the routing is balanced (as the auxiliary loss aims), up to {skewed:,} when "
                f"every token of the {recipe.ep_size} GPUs picks as many of its experts as top-{per_token} allows; "
                f"traced {recipe.ep_routing} ({kernel})")
    copies = (f"; batched_mm copies the expert weights of each of the {rows:,} routed rows, {rows:,} copies of one "
              "expert's weights per layer kept for backward (meant for decoding a few tokens: grouped_mm, "
              "transformers' default, reads the weights in place)" if kernel == "batched_mm" else "")
    return (f"Mixture of Experts ({kernel}): balanced routing assumed, as the auxiliary loss aims ({tokens:,} "
            f"tokens x top-{per_token} / {experts} experts = {rows / experts:,.0f} tokens per expert and layer); "
            f"{kernel} runs all {rows:,} routed rows whatever the split, so a skewed one, up to an expert receiving "
            f"every token, keeps the same memory and costs time only (not modelled); {kept}{copies}")
