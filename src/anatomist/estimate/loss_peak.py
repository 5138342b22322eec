"""Say so when the peak of a step is the logits of the loss.

A language-model head turns every token into a vocabulary-wide row of logits, and transformers'
loss upcasts them to fp32 and keeps the log-softmax for backward: at 128k-150k vocabularies and
long sequences these copies, not the blocks' activations, are often what the peak is made of
(batch 1 x 32,768 tokens x 151,936 vocabulary is 18.5 GiB per fp32 copy). The trace knows which
bytes they are: the activations and temporaries made after the last block (`Curves.post_bytes`),
which do not depend on the depth. This module finds the peak of the full model's "post" segment,
extrapolated as the estimator extrapolates every point, and when the step's peak is that point
and those bytes are a large share of it, writes the note.

Criterion (both must hold):
- the peak is in the "post" segment of forward or backward: the post segment's highest point has
  the activations and temporaries of the anatomy's peak (within `SAME_POINT_TOLERANCE`; the
  other categories are not compared, as ZeRO sharding changes them);
- the bytes made after the last block are at least `LOSS_SHARE` (half) of the activations and
  temporaries there: the head and the loss hold more of the peak than all the blocks' saved
  activations together. (Llama-3.1-8B at 131,072 tokens without gradient checkpointing peaks in
  the loss too, but its 192 GiB of logits are a fifth of 1,024 GiB: the blocks are the problem
  there, and the note would mislead.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from anatomist.anatomy import GIB, TENSOR_CATEGORIES, MemoryAnatomy, MemoryCategory, Phase
from anatomist.axes.liger import liger_modelled
from anatomist.estimate.traces import TRACE_BATCHES, StepTraces, affine
from anatomist.recipe import ResolvedRecipe
from anatomist.recipe.axis_values import half_dtype
from anatomist.trace.depth.cuts import Depth
from anatomist.workload import Workload

LOSS_SHARE = 0.5
"""Share of the peak's activations and temporaries that the head and the loss must hold for the note."""
SAME_POINT_TOLERANCE = 1e-3
"""Relative difference under which the post segment's peak is taken to be the step's peak."""

_TRANSIENT = [TENSOR_CATEGORIES.index(MemoryCategory.ACTIVATIONS), TENSOR_CATEGORIES.index(MemoryCategory.TEMPORARY)]


@dataclass(frozen=True, slots=True)
class LossPeak:
    """The highest point of the full model's post segment (head and loss) in one phase."""

    transient_bytes: float
    """Activations + temporaries live there."""
    loss_bytes: float
    """Of those, the bytes made after the last block (logits, their fp32 copy, log-softmax, gradients)."""


def post_segment_peak(traces: StepTraces, phase: Phase, batch: int) -> LossPeak | None:
    """The post segment's highest point of the full model at `batch` samples, in `phase`; None where
    the traces have no post segment or its points do not line up between the cuts."""
    plan = traces.plan
    columns: dict[Depth, tuple[Any, Any]] = {}  # per cut: [points, categories] and [points], at `batch`
    for cut in plan.cuts:
        lo, hi = (traces.passes[cut, b].curves for b in TRACE_BATCHES)
        keys = sorted(k for k in lo.index if k[0] is phase and k[1] == "post")
        if not keys or lo.keys != hi.keys:
            return None
        at = np.concatenate([lo.index[k] for k in keys])
        columns[cut] = (affine(lo.categories[at], hi.categories[at], batch, TRACE_BATCHES[0]),  # type: ignore[arg-type]
                        affine(lo.post_bytes[at], hi.post_bytes[at], batch, TRACE_BATCHES[0]))  # type: ignore[arg-type]
    if len({len(p) for _, p in columns.values()}) != 1:
        return None
    categories: Any = plan.combine(lambda c: columns[c][0])  # point by point, as the estimator's curves
    post: Any = plan.combine(lambda c: columns[c][1])
    i = int(np.argmax(categories.sum(axis=1)))
    return LossPeak(transient_bytes=float(categories[i, _TRANSIENT].sum()), loss_bytes=float(post[i]))


def loss_peak_note(workload: Workload, recipe: ResolvedRecipe, anatomy: MemoryAnatomy, traces: StepTraces) -> str | None:
    """The note for an anatomy whose peak is the logits of the loss (see the module's criterion), else None."""
    if anatomy.peak_phase not in (Phase.FORWARD, Phase.BACKWARD) or recipe.use_liger_kernel:
        return None  # Liger's loss holds no logits (its own note, estimate/memory.py)
    if recipe.trainer != "trainer":
        return None  # nor TRL's fused LM head (its own note); after DPO's last block the reference runs, not a loss
    peak = post_segment_peak(traces, anatomy.peak_phase, recipe.per_device_train_batch_size)
    transient = anatomy.activations + anatomy.temporary
    if peak is None or transient <= 0:
        return None
    if abs(peak.transient_bytes - transient) > SAME_POINT_TOLERANCE * transient:
        return None  # the peak is elsewhere (in the blocks, or before them)
    if peak.loss_bytes < LOSS_SHARE * transient:
        return None
    return (f"the peak is the logits of the loss: {peak.loss_bytes / GIB:.1f} GiB of the {transient / GIB:.1f} GiB "
            f"of activations and temporaries at the peak (in {anatomy.peak_phase}) are the LM head's output and "
            f"the loss's copies of it ({_logits_size(workload, recipe)}); fewer tokens per micro-batch shrink them "
            f"in proportion, gradient checkpointing does not{_fused_hint(workload)}")


def _fused_hint(workload: Workload) -> str:
    """What would take the logits out of the peak, where anatomist models it."""
    if liger_modelled(workload.model_type, workload.task):
        return "; Liger Kernel's fused linear + cross-entropy never holds them (--use-liger-kernel)"
    return ""


def _logits_size(workload: Workload, recipe: ResolvedRecipe) -> str:
    """`batch x tokens x vocabulary` and what one copy of the logits takes in each dtype the loss holds (a GPU's
    tokens: under context or sequence parallel its part of each sequence)."""
    vocab = workload.facts.vocab_size
    batch = recipe.per_device_train_batch_size
    tokens = workload.seq_len // recipe.sequence_parts
    elements = batch * tokens * vocab
    half_name = {"bfloat16": "bf16", "float16": "fp16"}.get(half_dtype(recipe) or "")
    copies = f"{elements * 2 / GIB:.1f} GiB per {half_name} copy, " if half_name else ""
    return (f"{batch} x {tokens:,} tokens x {vocab:,} vocabulary: {copies}"
            f"{elements * 4 / GIB:.1f} GiB per fp32 copy")
