"""FLOPs and bytes moved by every op of one training step, from the estimator's traces.

The traces (`traces.step_traces`, fake tensors, no GPU) record each op's cost signature
(`trace.engine.op_costs.op_signature`: FLOPs by PyTorch's flop_counter formulas, 2 per multiply-add;
bytes read + written; class; phase) for one micro-batch's forward and backward (with
recomputation under gradient checkpointing) and one optimizer step. The same traces give the
memory prediction. `step_flops` counts a step two ways: hardware FLOPs (what runs, recomputation
included: HFU) and model FLOPs (the same step without gradient checkpointing: MFU).

Batch size: each op's FLOPs and bytes are affine in it, so the passes at any batch size are
extrapolated op by op from the traces at 2 and 3 samples (where the two op sequences do not
line up, the batch is traced directly). Depth: op counts are linear in the number of
repeated blocks of each kind, so the step is extrapolated from the cuts of the estimator's plan
(`trace.depth.plan`), for a uniform stack the traces at 2 and 3 blocks: n(L) = n2 + (L - 2)(n3 - n2).

Known limitations: the CPU code paths stand in for CUDA's (`trace.engine.cuda_paths`), so a few ops
differ from what CUDA runs (e.g. CPU's flash-attention kernel stands in for the CUDA SDPA
kernels; its FLOPs are counted with the same formula as CUDA's).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from anatomist.anatomy import STEP_PHASES, OpClass, Phase, StepFlops
from anatomist.axes.liger import liger_chunks
from anatomist.estimate.sharding import as_deepspeed_runs
from anatomist.estimate.traces import TRACE_BATCHES, TRACE_DEPTHS, affine, step_traces
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.depth.cuts import Depth
from anatomist.trace.depth.plan import TracePlan
from anatomist.trace.engine.records import ATTENTION_PREFIX, CHUNK_WEIGHT_PASS, NO_GEMM, Signature
from anatomist.trace.store import cache
from anatomist.trace.store.keys import one_device, part_key
from anatomist.trace.store.parts import trace_part
from anatomist.workload import Workload

DEFAULT_COMPUTE_CAPABILITY = "8.0"
"""Where no GPU is named: the ops do not depend on it (only the traced cuBLAS workspace does)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class OpRecord:
    """All calls of one op with one signature in one phase: per-call cost and call count."""

    name: str
    """ATen base name, e.g. `addmm`, `native_layer_norm_backward`."""
    op_class: OpClass
    phase: Phase
    dtype: str
    """dtype of the op's first floating-point input (the precision its kernel runs in)."""
    flops: int
    """FLOPs of one call by flop_counter's formulas (0 for ops it does not count)."""
    approx_flops: int
    """FLOPs of one call of a non-contraction op, approximated per element (not in `flops`)."""
    bytes: int
    """Bytes one call reads and writes: input + output tensor bytes (0 for views)."""
    count: float
    """Calls per micro-batch (forward, backward) or per step (optimizer); extrapolated in depth."""
    view: bool
    known: bool
    """False when op_classes.toml does not list the op (it is then `other`)."""
    gemm: tuple[int, int, int, int] = NO_GEMM
    """A matrix product's (batch, m, n, k) (`Signature.gemm`); zeros for other ops."""

    def calls_per_step(self, accumulation: int) -> float:
        """Calls in one optimizer step: the passes repeat per micro-batch, the optimizer step runs once."""
        return self.count * (1 if self.phase is Phase.OPTIMIZER else accumulation)


@dataclass(kw_only=True, slots=True)
class StepOps:
    """The op records of one training micro-step plus optimizer step, at full depth."""

    records: list[OpRecord]

    def flops(self, phase: Phase | None = None) -> float:
        return sum(r.flops * r.count for r in self.records if phase is None or r.phase is phase)

    def kernels(self, phase: Phase) -> float:
        """Kernel calls of `phase` per micro-batch (forward, backward) or per step (optimizer); views are none."""
        return sum(r.count for r in self.records if r.phase is phase and not r.view)

    def flops_per_step(self, accumulation: int) -> int:
        """FLOPs of one optimizer step of `accumulation` micro-batches."""
        return round(accumulation * (self.flops(Phase.FORWARD) + self.flops(Phase.BACKWARD)) + self.flops(Phase.OPTIMIZER))

    def unknown_ops(self) -> list[str]:
        return sorted({r.name for r in self.records if not r.known})


_PASSES_OPS = cache.Memo(1024)


def passes_ops(workload: Workload, recipe: ResolvedRecipe, depth: Depth, compute_capability: str) -> tuple[Signature, ...]:
    """The ops of one micro-batch's passes at the recipe's batch size, of the model cut to `depth`.

    At any batch the passes run the same ops in the same order, and each op's FLOPs and
    bytes are affine in the batch size (weights fixed, activations per sample), so the
    traces at TRACE_BATCHES give every op's cost exactly. Where the sequences do not line
    up, the batch is traced directly."""
    batch = recipe.per_device_train_batch_size
    key = part_key(workload, recipe, "forward-backward", depth, batch, compute_capability)
    return _PASSES_OPS.get(key, lambda: passes_with_chunks(_passes_ops(workload, recipe, depth, batch, compute_capability),
                                                       workload, batch))


def passes_with_chunks(ops: tuple[Signature, ...], workload: Workload, batch: int) -> tuple[Signature, ...]:
    """`ops` with the traced chunk's `chunk_weight_pass` (Liger's fused linear + cross-entropy) repeated for every
    chunk but the traced one: Liger's chunk is a power of two of tokens (`axes.liger.liger_chunks`), so the number
    of chunks, each reading the head's weight, is no affine function of the batch that the traces could give."""
    facts = workload.facts
    if facts.hidden_size <= 0 or not any(op.name == CHUNK_WEIGHT_PASS for op in ops):
        return ops
    others = liger_chunks(batch * workload.seq_len, facts.hidden_size, facts.vocab_size) - 1
    return tuple(repeated for op in ops for repeated in ((op,) * others if op.name == CHUNK_WEIGHT_PASS else (op,)))


def _passes_ops(workload: Workload, recipe: ResolvedRecipe, depth: Depth, batch: int, compute_capability: str,
                ) -> tuple[Signature, ...]:

    def traced(b: int) -> tuple[Signature, ...]:
        return trace_part(workload, recipe, "forward-backward", depth=depth, batch_size=b,
                          compute_capability=compute_capability).ops

    lo, hi = (traced(b) for b in TRACE_BATCHES)
    if batch in TRACE_BATCHES:
        return lo if batch == TRACE_BATCHES[0] else hi
    if [a.kind() for a in lo] != [b.kind() for b in hi]:
        return traced(batch)
    costs = np.rint(affine(np.array([a.costs() for a in lo], dtype=np.float64),
                           np.array([b.costs() for b in hi], dtype=np.float64), batch, TRACE_BATCHES[0]))
    return tuple(a.with_costs(*map(int, c)) for a, c in zip(lo, costs.tolist(), strict=True))


def _step_at_depth(workload: Workload, recipe: ResolvedRecipe, depth: Depth, compute_capability: str) -> Counter[Signature]:
    """Call counts of every op signature of one micro-batch and one optimizer step of the model cut to `depth`."""
    optimizer = trace_part(workload, recipe, "optimizer", depth=depth, batch_size=1,
                           compute_capability=compute_capability)
    return Counter(passes_ops(workload, recipe, depth, compute_capability)) + Counter(optimizer.ops)


_STEP_OPS = cache.Memo(1024)
"""step_ops by the keys of the traces it reads: recipes that differ in what no trace sees
(sharding, torch.compile, accumulation beyond 2) share it."""


def step_ops(workload: Workload, recipe: ResolvedRecipe, compute_capability: str = DEFAULT_COMPUTE_CAPABILITY) -> StepOps:
    """Op records of one micro-batch (forward, backward) and one optimizer step, at full depth: from
    the cuts of the estimator's plan (`traces.step_traces`), or a cut as deep as the model; of one
    device's step (`keys.one_device`: a rank computes what one device does on its micro-batch; what
    sharding adds is `cluster.predict_time`'s; under DeepSpeed, its step as the engine runs it:
    `sharding.as_deepspeed_runs`). The result is shared: do not change it."""
    recipe = as_deepspeed_runs(one_device(recipe))
    key = (part_key(workload, recipe, "forward-backward", None, recipe.per_device_train_batch_size, compute_capability),
           part_key(workload, recipe, "optimizer", None, 1, compute_capability))
    return _STEP_OPS.get(key, lambda: _step_ops(workload, recipe, compute_capability))


def _step_ops(workload: Workload, recipe: ResolvedRecipe, compute_capability: str) -> StepOps:
    plan = step_traces(workload, recipe, compute_capability).plan
    layers = plan.deltas[0].multiplier + TRACE_DEPTHS[0] if plan.how == "uniform" else None
    if plan.how == "full" or (layers is not None and (layers in TRACE_DEPTHS or layers < TRACE_DEPTHS[0])):
        calls = _step_at_depth(workload, recipe, layers if plan.how == "uniform" else None, compute_capability)
        records = [_record(sig, float(n)) for sig, n in calls.items()]
    else:
        counts = {c: _step_at_depth(workload, recipe, c, compute_capability) for c in plan.cuts}
        records = _extrapolate(plan, counts)
    if recipe.cp_size > 1:
        records = [_ring_in_causal_convention(r, recipe.cp_size) for r in records]
    records.sort(key=lambda r: (STEP_PHASES.index(r.phase), -r.flops * r.count, -r.bytes * r.count))
    return StepOps(records=records)


def _ring_in_causal_convention(record: OpRecord, cp_size: int) -> OpRecord:
    """A context parallel rank's attention kernel (forward or backward) counted as the time model counts one GPU's
    causal attention: PyTorch's flop counter gives a causal kernel its whole S x S product (a flash kernel computes about
    half of it), and the calibration's factors were fitted on that count. Of a rank's ring steps only the first is
    causal, (S/C)^2 counted; the C - 1 others, S/2C queries against S/C keys each, compute all they count. In that
    convention the whole sequence counts S^2 and a load-balanced rank 1/C of it, (C + 1) / 2C of what its steps count:
    so its attention records are scaled by 2C / (C + 1), and C ranks count what one GPU's sequence counts."""
    if not record.name.startswith(ATTENTION_PREFIX):
        return record
    return dataclasses.replace(record, flops=round(record.flops * 2 * cp_size / (cp_size + 1)))


def ops_of(signatures: Iterable[Signature]) -> StepOps:
    """The records of `signatures`, the ops of one traced part at full depth (each signature's calls counted)."""
    return StepOps(records=[_record(sig, float(n)) for sig, n in Counter(signatures).items()])


def _record(sig: Signature, count: float) -> OpRecord:
    return OpRecord(name=sig.name, op_class=sig.op_class, phase=sig.phase, dtype=sig.dtype, flops=sig.flops,
                    approx_flops=sig.approx_flops, bytes=sig.bytes, count=count, view=sig.view, known=sig.known,
                    gemm=sig.gemm)


def _extrapolate(plan: TracePlan, counts: dict[Depth, Counter[Signature]]) -> list[OpRecord]:
    """Records of the full model from the call counts of the plan's cuts (`TracePlan.combine`).

    An op whose per-call cost is the same in every cut (every op of a block, and those before
    and after the blocks) keeps its exact per-call cost; its count is affine in the blocks of
    each kind. An op whose per-call cost grows with depth (the optimizer's foreach kernels
    over all parameters) has its totals extrapolated and is costed at the mean per call.
    """

    def count_at(sig: Signature) -> float:
        return plan.combine(lambda c: counts[c].get(sig, 0))

    groups: dict[tuple[Any, ...], list[Signature]] = {}
    for sig in dict.fromkeys(s for calls in counts.values() for s in calls):  # in trace order: sums do not depend on hashing
        groups.setdefault(sig.kind(), []).append(sig)
    records: list[OpRecord] = []
    for sigs in groups.values():
        at = {sig: count_at(sig) for sig in sigs}
        if all(n >= 0 for n in at.values()):
            records.extend(_record(sig, float(n)) for sig, n in at.items() if n > 0)
            continue
        count = sum(at.values())
        if count <= 0:
            continue
        mean_cost = [sum(sig.costs()[i] * at[sig] for sig in sigs) / count for i in range(len(sigs[0].costs()))]
        records.append(_record(sigs[0].with_costs(*(round(c) for c in mean_cost)), count))
    return records


def recomputing_nothing(recipe: ResolvedRecipe) -> ResolvedRecipe:
    """`recipe` without checkpointing, whose FLOPs are the model's (`step_flops`). Compiled Liger is modelled only
    with checkpointed blocks, which are traced eager (`Recipe`), so its step is eager here: compiling changes no
    matrix product."""
    return dataclasses.replace(recipe, gradient_checkpointing=False, checkpoint_every=1, checkpoint_offload=False,
                               torch_compile=recipe.torch_compile and not recipe.use_liger_kernel)


def recomputed_kernels(workload: Workload, recipe: ResolvedRecipe,
                       compute_capability: str = DEFAULT_COMPUTE_CAPABILITY) -> float:
    """Kernels per micro-batch that checkpointing adds to the backward (the checkpointed layers' forward, run
    again): the backward's kernels of the step less those of the same step traced without checkpointing (both the
    Trainer's step: a loop of another code, benchmarks/published/loops.py, adds kernels of its own to the backward)."""
    if not recipe.gradient_checkpointing:
        return 0.0
    plain = step_ops(workload, recomputing_nothing(recipe), compute_capability)
    return max(0.0, step_ops(workload, recipe, compute_capability).kernels(Phase.BACKWARD)
               - plain.kernels(Phase.BACKWARD))


def step_flops(workload: Workload, recipe: ResolvedRecipe, compute_capability: str = DEFAULT_COMPUTE_CAPABILITY, *,
               ops: StepOps | None = None) -> StepFlops:
    """FLOPs of one optimizer step, accumulation x (forward + backward) + optimizer, two ways:
    hardware FLOPs, what the recipe runs (gradient checkpointing's recomputed forward
    included), and model FLOPs, the same step traced without gradient checkpointing.

    Model FLOPs come from a trace without checkpointing rather than by subtracting the
    recomputation, because checkpointing changes more than the recomputed forward: with
    frozen embeddings (PEFT) transformers makes the input require a gradient so that the
    checkpointed blocks get one, and backward then also computes the gradient of the first
    block's input, which the model's math does not need.

    Counted by PyTorch's flop_counter formulas on the real model code (2 FLOPs per
    multiply-add; matrix products, convolutions and attention only, the MFU convention).

    Args:
        ops: `step_ops(workload, recipe)` where the caller has them already.
    """
    accumulation = recipe.gradient_accumulation_steps
    hardware = (ops or step_ops(workload, recipe, compute_capability)).flops_per_step(accumulation)
    if not recipe.gradient_checkpointing:
        return StepFlops(model=hardware, hardware=hardware)
    plain = step_ops(workload, recomputing_nothing(recipe), compute_capability)
    return StepFlops(model=plain.flops_per_step(accumulation), hardware=hardware)
