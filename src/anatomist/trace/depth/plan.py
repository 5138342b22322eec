"""Which cuts of a model to trace, and how their traces add up to the full model.

The estimator traces models cut to a few blocks and extrapolates. Every figure of a step is
affine in the number of blocks of each kind, so a plan (`TracePlan`) names a base cut and, per
kind, a cut with one more block of it; the full model is the base plus, per kind, its difference
as many times as the full model has more blocks of that kind. Which cuts follows from the
model's layout (`stack.layout_of`, built on the meta device):

- uniform (one stack of blocks alike after the first: BERT, Llama, Qwen, flan-T5): the model cut
  to 2 and 3 blocks (`TRACE_DEPTHS`);
- by kind (blocks of several kinds: Gemma's sliding and global layers, DeepSeek's dense then MoE
  layers, T5's encoder and decoder of different depths, hybrids): a base cut that keeps the first
  and last layer of each stack and one layer of each kind, and per kind a cut with one more
  layer of it, placed before the stack's last;
- full depth, where no cut is exact (ALBERT's shared layers; layers that follow a rule no cut of
  the config keeps, found by building each cut) or where the cuts would trace as many blocks as
  the model has.

The plan and the model's exact parameter count are kept in the trace cache with the traces
(`ModelPlan`): a warm estimate does not build the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from anatomist.trace.depth.cuts import Cut, CutStack, Depth
from anatomist.trace.store import cache
from anatomist.trace.store.keys import plan_key

if TYPE_CHECKING:
    from anatomist.recipe import ResolvedRecipe
    from anatomist.trace.depth.layout import Layout
    from anatomist.workload import Workload

TRACE_DEPTHS = (2, 3)
"""Blocks of the traced models of a uniform stack: not 1, where the first block, which reads the
embeddings, would be the only one."""

CUT_OVERHEAD_BLOCKS = 2
"""What tracing one more cut costs beyond its blocks (building it, embeddings, head, loss), in blocks:
where the cuts by kind would cost as much as the full model, the full model is traced (exact)."""



@dataclass(frozen=True, slots=True)
class Delta:
    """A cut with blocks added to the base, and how many times the full model has them more."""

    cut: Depth
    multiplier: int
    inserted: tuple[int, ...]
    """The places, among the cut's blocks in the model's order, of the blocks it adds to the base's."""

    def aligned(self, block: int) -> int:
        """The place in this cut of the base's block `block` (the added blocks skipped)."""
        for place in sorted(self.inserted):
            if place <= block:
                block += 1
        return block


@dataclass(frozen=True, slots=True)
class TracePlan:
    """Which cuts are traced and how they add up to the full model:
    value(full) = value(base) + sum over deltas of multiplier x (value(delta.cut) - value(base))."""

    base: Depth
    deltas: tuple[Delta, ...]
    how: Literal["uniform", "by-kind", "full"]
    note: str | None = None
    """What the Estimate's notes say of this plan (None: nothing worth saying)."""

    @property
    def cuts(self) -> tuple[Depth, ...]:
        return (self.base, *(d.cut for d in self.deltas))

    @property
    def deepest(self) -> Depth:
        """The cut with the most blocks: its reserve ratio stands for the full model's."""
        return self.deltas[-1].cut if self.deltas else self.base

    def combine(self, value: Callable[[Depth], float]) -> float:
        base = value(self.base)
        return base + sum(d.multiplier * (value(d.cut) - base) for d in self.deltas)


@dataclass(frozen=True, slots=True)
class ModelSize:
    """The full model's size as the recipe trains it, counted on the model built on the meta device
    (`layout.Layout`): what the estimator reads beside the traces (the exact parameter count the traces must add up
    to, the arithmetic of sharding, collectives and offload, the notes)."""

    parameters: int
    """Parameters of the full model as the recipe trains it (`layout.Layout.parameters`)."""
    trainable_parameters: int
    blocks: int
    """Repeated blocks of the full model (0 where no stack was found)."""
    parameter_numels: tuple[int, ...] = ()
    """Elements of each parameter of the full model, ascending (DeepSpeed ZeRO-3 keeps those below its
    persistence threshold whole on every device)."""
    block_parameters: int = 0
    """Parameters of the largest repeated block (an FSDP unit; DeepSpeed's gathered working set)."""
    quantized_codes: int = 0
    """Bytes of a quantized base's 4-/8-bit codes, whose elements `parameter_numels` counts too."""
    quantized_parameters: int = 0
    """Parameters of the base that bitsandbytes quantizes, as its authors count them (`layout.Layout`)."""
    adapted_parameters: tuple[str, ...] = ()
    """The parameters PEFT adapts directly (its target_parameters), named within their layer (`layout.Layout`)."""
    rows_divisor: int = 1
    """The greatest common divisor of every parameter's rows (dim 0): FSDP's shards at a world size that divides it
    are even (`trace.depth.worlds`)."""
    trainable_bytes: int = 0
    """Bytes of the trainable parameters in their dtypes, as their gradients are: what DistributedDataParallel's
    gradient buckets hold (`estimate.sharding.ddp_bucket_bytes`)."""
    parameter_bytes: int = 0
    """Bytes of every parameter in its dtype, as one flat buffer holds them (ZeRO-3's partitions)."""
    fp8_weights: int = 0
    """Elements of the weights accelerate converts to torchao's Float8Linear under `Recipe.fp8`
    (`trace.step.fp8`): FSDP gathers them in float8 where `fp8_all_gather` is on."""
    expert_parameters: int = 0
    """Elements of a Mixture of Experts' routed experts (`layout.expert_parameters`): under expert parallel FSDP
    gathers a rank's share of them only among the ranks that hold the same experts (`collectives`)."""


@dataclass(frozen=True, slots=True)
class ModelPlan:
    """What the estimator keeps of a model's layout: which cuts to trace, and the full model's size."""

    plan: TracePlan
    size: ModelSize


def model_plan(workload: Workload, recipe: ResolvedRecipe, *, use_cache: bool = True) -> ModelPlan:
    """The trace plan and exact parameter count of `workload`'s model under the recipe's PEFT
    setting: from the trace cache, else from the model built on the meta device."""

    def make() -> ModelPlan:
        from anatomist.trace.depth.layout import layout_of  # builds the model: imports torch

        layout = layout_of(workload, recipe)
        size = ModelSize(parameters=layout.parameters, trainable_parameters=layout.trainable_parameters,
                         blocks=layout.blocks, parameter_numels=layout.parameter_numels,
                         block_parameters=layout.block_parameters, quantized_codes=layout.quantized_codes,
                         quantized_parameters=layout.quantized_parameters,
                         adapted_parameters=layout.adapted_parameters, rows_divisor=layout.rows_divisor,
                         trainable_bytes=layout.trainable_bytes, parameter_bytes=layout.parameter_bytes,
                         fp8_weights=layout.fp8_weights, expert_parameters=layout.expert_parameters)
        return ModelPlan(plan=trace_plan(workload, recipe, layout), size=size)

    if not use_cache:
        return make()
    key = plan_key(workload, recipe)
    return cache.get_or_trace(key, make, ModelPlan)


def full_plan(blocks: int, why: str) -> TracePlan:
    """Trace the whole model (`blocks`: how many repeated blocks it has, for the note)."""
    counted = f" ({blocks} blocks)" if blocks else ""
    return TracePlan(base=None, deltas=(), how="full", note=f"{why}: traced at full depth{counted}, not extrapolated")


def trace_plan(workload: Workload, recipe: ResolvedRecipe, layout: Layout) -> TracePlan:
    """The cuts to trace for `layout` (see the module docstring)."""
    if not layout.stacks:
        return full_plan(layout.blocks, "no stack of blocks as deep as the config says (shared or unlisted layers)")
    if layout.uniform():
        stack = layout.stacks[0]
        lo, hi = TRACE_DEPTHS
        # The added block is the one before the last of each ModuleList (T5: encoder and decoder).
        inserted = tuple(j * hi + hi - 2 for j in range(len(stack.paths)))
        return TracePlan(base=lo, deltas=(Delta(cut=hi, multiplier=stack.depth - lo, inserted=inserted),),
                         how="uniform")
    plan = _by_kind(layout)
    traced = sum(c.blocks + CUT_OVERHEAD_BLOCKS for c in plan.cuts if isinstance(c, Cut))
    kinds = sum(len(set(s.kinds)) for s in layout.stacks)
    if traced >= layout.blocks + CUT_OVERHEAD_BLOCKS:
        return full_plan(layout.blocks, f"{kinds} kinds of layer in {layout.blocks}: cuts by kind would trace as much")
    from anatomist.trace.depth.layout import cut_matches

    if not all(cut_matches(workload, recipe, layout, c) for c in plan.cuts if isinstance(c, Cut)):
        return full_plan(layout.blocks, f"{kinds} kinds of layer that a cut of the config does not keep")
    return plan


def _by_kind(layout: Layout) -> TracePlan:
    """Base: the first and last layer of each stack and the first of each kind it lacks; per kind with
    more layers than that, the base plus one more layer of the kind, before the stack's last."""
    kept = []
    for stack in layout.stacks:
        chosen = {0, stack.depth - 1}
        for kind in sorted(set(stack.kinds)):
            if kind not in {stack.kinds[i] for i in chosen}:
                chosen.add(stack.kinds.index(kind))
        kept.append(tuple(sorted(chosen)))

    def cut(layers: list[tuple[int, ...]]) -> Cut:
        return Cut(stacks=tuple(CutStack(fields=s.fields, depth=s.depth, kept=k)
                                for s, k in zip(layout.stacks, layers, strict=True)))

    deltas = []
    for n, stack in enumerate(layout.stacks):
        for kind in sorted(set(stack.kinds)):
            more = stack.kinds.count(kind) - sum(1 for i in kept[n] if stack.kinds[i] == kind)
            if more == 0:
                continue
            added = next(i for i, k in enumerate(stack.kinds) if k == kind and i not in kept[n])
            layers = list(kept)
            layers[n] = tuple(sorted({*kept[n], added}))
            before = sum(len(k) * len(s.paths) for k, s in zip(kept[:n], layout.stacks[:n], strict=True))
            place = layers[n].index(added)
            inserted = tuple(before + j * len(layers[n]) + place for j in range(len(stack.paths)))
            deltas.append(Delta(cut=cut(layers), multiplier=more, inserted=inserted))
    described = ", ".join(f"{s.depth} layers of {len(set(s.kinds))} kinds" + (f" in {s.fields[0]}" if len(layout.stacks) > 1 else "")
                          for s in layout.stacks)
    return TracePlan(base=cut(kept), deltas=tuple(deltas), how="by-kind",
                     note=f"layers of several kinds ({described}): traced a cut with one block of each kind "
                          "and extrapolated kind by kind")


