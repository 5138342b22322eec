"""The traces the estimator takes of a step, shared by the memory and the time prediction.

A training step is traced in two parts (forward/backward, optimizer: `trace.step.trace_part`)
on models cut to a few blocks; the passes at `TRACE_BATCHES` samples. Everything the estimator
reports is extrapolated from these few traces: every figure of a step is affine in the number of
blocks of each kind and, for one cut, in the batch size (each block and each sample adds the
same tensors and the same ops). Which cuts (`TracePlan`) follows from the model's layout
(`trace.stack.layout_of`, built on the meta device):

- uniform (one stack of blocks alike after the first: BERT, Llama, Qwen): the model cut to 2 and
  3 blocks (`TRACE_DEPTHS`), extrapolated in depth;
- by kind (blocks of several kinds: Gemma's sliding and global layers, DeepSeek's dense then MoE
  layers, T5's encoder and decoder of different depths, hybrids): a base cut that keeps the first
  and last layer of each stack and one layer of each kind, and per kind a cut with one more layer
  of that kind, placed before the stack's last; each kind's difference counts as many times as the
  full model has more layers of that kind;
- full depth, where no cut is exact (ALBERT's shared layers, layers that follow a rule no cut can
  keep) or where cutting would trace as many blocks as the model has.

After every plan, the parameter count the traces imply must equal the exact count of the full
model built on the meta device; where it does not, the model is traced at full depth, and where
even that disagrees the Estimate says so in its notes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from anatomist.recipe import Recipe
from anatomist.trace.records import StepTrace
from anatomist.trace.stack import Cut, CutStack, Layout, cut_matches, layout_of
from anatomist.trace.step import PEFT_FIELDS, Depth, trace_part
from anatomist.workload import Workload, resolve_dtype

Mode = Literal["train", "inference"]

TRACE_DEPTHS = (2, 3)
"""Blocks of the traced models of a uniform stack: not 1, where the first block, which reads the
embeddings, would be the only one."""
TRACE_BATCHES = (2, 3)
"""Batch sizes of the traces: not 1, where size-1 dimensions make some copies views, so the
op sequence (and the curve) differs from every larger batch."""
CUT_OVERHEAD_BLOCKS = 2
"""What tracing one more cut costs beyond its blocks (building it, embeddings, head, loss), in blocks:
where the cuts by kind would cost as much as the full model, the full model is traced (exact)."""


def affine(f_lo: float, f_hi: float, x: int, lo: int) -> float:
    """The value at x of the line through (lo, f_lo) and (lo + 1, f_hi)."""
    return f_lo + (x - lo) * (f_hi - f_lo)


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
class StepTraces:
    """The traces of one recipe: passes by (cut, batch), optimizer by cut (None in inference)."""

    plan: TracePlan
    passes: dict[tuple[Depth, int], StepTrace]
    optimizer: dict[Depth, StepTrace] | None
    parameters: int
    """Exact parameters of the full model as the recipe trains it (the meta-device count)."""
    trainable_parameters: int
    notes: tuple[str, ...]
    """What the Estimate must say of how it was traced (plans other than uniform, a count that
    does not add up)."""


_plans: dict[tuple[object, ...], tuple[Layout, TracePlan]] = {}


def model_plan(workload: Workload, recipe: Recipe) -> tuple[Layout, TracePlan]:
    """The model's layout (`trace.stack.layout_of`) and its trace plan, kept per model and PEFT
    setting for the process."""
    key = (*workload.trace_key(), tuple(getattr(recipe, f) for f in PEFT_FIELDS))
    if key not in _plans:
        layout = layout_of(workload, recipe)
        _plans[key] = layout, trace_plan(workload, recipe, layout)
    return _plans[key]


def full_plan(layout: Layout, why: str) -> TracePlan:
    blocks = f" ({layout.blocks} blocks)" if layout.blocks else ""
    return TracePlan(base=None, deltas=(), how="full", note=f"{why}: traced at full depth{blocks}, not extrapolated")


def trace_plan(workload: Workload, recipe: Recipe, layout: Layout) -> TracePlan:
    """The cuts to trace for `layout` (see the module docstring)."""
    if not layout.stacks:
        return full_plan(layout, "no stack of blocks as deep as the config says (shared or unlisted layers)")
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
        return full_plan(layout, f"{kinds} kinds of layer in {layout.blocks}: cutting would trace as many blocks")
    if not all(cut_matches(workload, recipe, layout, c) for c in plan.cuts if isinstance(c, Cut)):
        return full_plan(layout, f"{kinds} kinds of layer that a cut of the config does not keep")
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
    described = ", ".join(f"{len(set(s.kinds))} in {s.depth} ({'/'.join(s.fields)})" for s in layout.stacks)
    return TracePlan(base=cut(kept), deltas=tuple(deltas), how="by-kind",
                     note=f"layers of several kinds ({described}): traced a cut with one block of each kind "
                          "and extrapolated kind by kind")


def step_traces(workload: Workload, recipe: Recipe, compute_capability: str, mode: Mode = "train",
                *, use_cache: bool = True) -> StepTraces:
    """The passes of each cut of the plan at TRACE_BATCHES and, in training, the optimizer of each cut;
    at full depth instead where the parameters they imply are not the model's exact count."""
    recipe = resolve_dtype(workload, recipe)
    layout, plan = model_plan(workload, recipe)

    def traced(plan: TracePlan) -> StepTraces:
        part = "forward-backward" if mode == "train" else "inference"
        passes = {
            (c, b): trace_part(workload, recipe, part, depth=c, batch_size=b, compute_capability=compute_capability,
                               use_cache=use_cache)
            for c in plan.cuts for b in TRACE_BATCHES
        }
        optimizer = None
        if mode == "train":
            optimizer = {
                c: trace_part(workload, recipe, "optimizer", depth=c, batch_size=1,
                              compute_capability=compute_capability, use_cache=use_cache)
                for c in plan.cuts
            }
        return StepTraces(plan=plan, passes=passes, optimizer=optimizer, parameters=layout.parameters,
                          trainable_parameters=layout.trainable_parameters,
                          notes=(plan.note,) if plan.note else ())

    traces = traced(plan)
    implied = implied_parameters(traces)
    exact = (layout.parameters, layout.trainable_parameters)
    if implied != exact and plan.how != "full":
        why = (f"the traced cuts imply {implied[0]:,} parameters ({implied[1]:,} trainable), the model has "
               f"{exact[0]:,} ({exact[1]:,})")
        traces = traced(full_plan(layout, why))
        implied = implied_parameters(traces)
    if implied != exact:
        note = (f"the traces count {implied[0]:,} parameters ({implied[1]:,} trainable) but the model built on "
                f"the meta device has {exact[0]:,} ({exact[1]:,}): memory and time may be off accordingly")
        traces = StepTraces(plan=traces.plan, passes=traces.passes, optimizer=traces.optimizer,
                            parameters=traces.parameters, trainable_parameters=traces.trainable_parameters,
                            notes=(*traces.notes, note))
    return traces


def implied_parameters(traces: StepTraces) -> tuple[int, int]:
    """(parameters, trainable parameters) of the full model as the plan adds the traces up."""
    at = {c: traces.passes[c, TRACE_BATCHES[0]] for c in traces.plan.cuts}
    return (round(traces.plan.combine(lambda c: at[c].parameters)),
            round(traces.plan.combine(lambda c: at[c].trainable_parameters)))
