"""What a traced step records and what it comes to, as plain data (numpy, no torch).

A trace is a list of allocation and free events (`Trace`) plus the cost signature of every
op (`Signature`). Replayed through the caching-allocator model it becomes `Curves`: the live
bytes after every allocation, in total and per memory category, from which the peak of each
phase and segment is read (`PhasePeak`). `StepTrace` bundles what the estimator keeps of one
traced part of a step. None of these types needs torch, so a trace cache hit can be read
without importing it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from anatomist.anatomy import TENSOR_CATEGORIES, MemoryCategory, OpClass, Phase
from anatomist.trace.engine.allocator import CachingAllocator, round_size

SEGMENTS = ("pre", "blocks", "post")
"""Where in a phase an event happens: before, inside and after the repeated blocks."""

NO_GEMM = (0, 0, 0, 0)
"""`Signature.gemm` of an op that is no matrix product."""
COLLECTIVE_PREFIX = "_c10d_functional::"
"""The names of the collectives a traced rank runs itself (DTensor's, under tensor parallel): communication, not the
device's compute (`estimate.time.collectives.tensor_parallel_s`)."""
ULYSSES_ALL_TO_ALL = "deepspeed::dim_zero_all_to_all"
"""DeepSpeed's exchange between the ranks of a sequence parallel group (deepspeed/sequence/layer.py), priced by
`estimate.time.collectives.sequence_parallel_s`."""
NOT_DEVICE_COMPUTE = (COLLECTIVE_PREFIX, "c10d::", ULYSSES_ALL_TO_ALL)
"""The ops a rank's trace holds that are not its device's compute: the collectives, DTensor's functional ones, c10d's
own (expert parallel's exchange of its split sizes) and DeepSpeed's, priced by `estimate.time.collectives`."""
ATTENTION_PREFIX = "_scaled_dot_product"
"""The names of the fused attention kernels (and of their CPU stand-ins): (batch x heads) products of Sq x Sk, each a
sum over the head dimension."""

CHUNK_WEIGHT_PASS = "anatomist::chunk_weight_pass"
"""The stand-in op (`trace.standins.kernel_ops`) of what one chunk of a chunked loss moves of the head's weight: one
call per trace, repeated by the time model for the chunks of the recipe's batch (`estimate.time.ops`)."""


class Signature(NamedTuple):
    """The cost of one op call, as the tracer records it (`trace.engine.op_costs.op_signature`).

    A typed tuple, not a dataclass: one is made per traced op and thousands are read back with every cached trace;
    a frozen dataclass made both measurably slower (tracing, and a warm estimate's unpickling)."""

    name: str
    """ATen base name, e.g. `addmm`, `native_layer_norm_backward`."""
    op_class: OpClass
    phase: Phase
    dtype: str
    """dtype of the op's first floating-point input (the precision its kernel runs in)."""
    flops: int
    """FLOPs by flop_counter's formulas (0 for ops it does not count)."""
    approx_flops: int
    """FLOPs of a non-contraction op, approximated per element (not in `flops`)."""
    bytes: int
    """Bytes read and written: input + output tensor bytes (0 for views)."""
    view: bool
    known: bool
    """False when op_classes.toml does not list the op (it is then `other`)."""
    gemm: tuple[int, int, int, int] = NO_GEMM
    """A matrix product's (batch, m, n, k): its output is `batch` matrices of m x n, each a sum over k (the
    time model tiles it: `estimate.time.tiles`); zeros for every other op (`trace.engine.op_costs.gemm_shape`)."""

    def kind(self) -> tuple[str, OpClass, Phase, str, bool, bool]:
        """The signature less its per-call costs: what the same op has at every batch size and depth."""
        return self.name, self.op_class, self.phase, self.dtype, self.view, self.known

    def costs(self) -> tuple[int, ...]:
        """The per-call costs (flops, approx_flops, bytes) and the product's shape (`gemm`): each affine in the batch
        size (a shape's rows, its sum or its batch grow with the samples, the others stay)."""
        return self.flops, self.approx_flops, self.bytes, *self.gemm

    def with_costs(self, flops: int, approx_flops: int, moved: int, batch: int, m: int, n: int, k: int) -> Signature:
        """The same op at other per-call costs and product shape, as `costs` orders them."""
        return Signature(self.name, self.op_class, self.phase, self.dtype, flops, approx_flops, moved, self.view,
                         self.known, (batch, m, n, k))


@dataclass(slots=True)
class Allocation:
    """One storage's life: its size, when it was made and what it turned out to be."""

    alloc_id: int
    nbytes: int
    phase: Phase
    category: MemoryCategory = MemoryCategory.TEMPORARY
    fixed: bool = False
    """True once the category is settled (weights, gradients, states are not re-labelled)."""
    op: str = ""
    """The ATen op that made it ("" for registered tensors)."""
    host: bool = False
    """In host memory, not the device's (FSDP's CPU offload): left out of the curves."""
    stream: int = 0
    """The CUDA stream it is allocated on (COMPUTE_STREAM, or FSDP2's ALL_GATHER_STREAM / REDUCE_SCATTER_STREAM):
    the allocator model keeps each stream's cached blocks apart."""


COMPUTE_STREAM, ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM = 0, 1, 2


@dataclass(slots=True)
class Event:
    """An allocation (`nbytes` > 0) or free (`nbytes` < 0) in program order."""

    alloc_id: int
    nbytes: int
    phase: Phase
    segment: str = "pre"
    """Where in the phase: "pre" (before the repeated blocks), "blocks", "post" (after them)."""
    micro_step: int = 0
    """Which micro-batch of an accumulating step (0 or 1)."""
    block: int = -1
    """In the "blocks" segment, which block (its place among the model's repeated blocks); else -1."""


@dataclass(slots=True)
class Trace:
    """What a tracer recorded: the allocations, the ordered alloc/free events, the ops."""

    allocations: dict[int, Allocation] = dataclasses.field(default_factory=dict)
    events: list[Event] = dataclasses.field(default_factory=list)
    ops: list[Signature] = dataclasses.field(default_factory=list)
    """The cost signature of every op of the first micro-batch and the optimizer step, in order."""
    op_count: int = 0
    offloaded_bytes: int = 0
    """Bytes the first micro-batch's forward copied to the host (TRL's activation offloading: `trace.step.offload`)."""


@dataclass(kw_only=True, slots=True)
class PhasePeak:
    """The highest allocated bytes within one phase, what was live then, and the reserve."""

    allocated: int
    reserved: int
    categories: dict[MemoryCategory, int]

    @classmethod
    def from_vector(cls, allocated: float, categories: np.ndarray | list[float]) -> PhasePeak:
        rounded = [max(0, round(float(x))) for x in categories]
        by_category = dict(zip(TENSOR_CATEGORIES, rounded, strict=True))
        total = sum(by_category.values())  # equal to allocated but for rounding
        return cls(allocated=total, reserved=total, categories=by_category)


@dataclass(kw_only=True, slots=True)
class Curves:
    """Allocated bytes after every allocation of a trace, in total and per category.

    Traces of the same model and depth at two batch sizes run the same ops, so their
    curves line up event by event, and each point is affine in the batch size.
    """

    keys: list[tuple[Phase, str, int, int]]
    """(phase, segment, micro-step, block) of each point."""
    allocated: np.ndarray
    """[points] live bytes (each tensor rounded to the allocator's 512 B) after the allocation.

    The allocator's own `allocated` also counts the slack of cached blocks it did not
    split, which depends on the whole history of the process; it is left to the reserve."""
    categories: np.ndarray
    """[points, len(TENSOR_CATEGORIES)] the same bytes by category."""
    reserve_ratio: float
    """Peak reserved over peak live bytes of the allocator replay."""
    post_bytes: np.ndarray
    """[points] activation and temporary bytes live that were made in the "post" segment (after the
    last block: the head and the loss, forward and backward). A causal LM's logits, their fp32 copy
    and the loss's log-softmax are these; they do not depend on the depth."""
    index: dict[tuple[Phase, str, int, int], np.ndarray] = dataclasses.field(init=False)
    """The positions of each key's points, in order."""

    def __post_init__(self) -> None:
        positions: dict[tuple[Phase, str, int, int], list[int]] = {}
        for i, key in enumerate(self.keys):
            positions.setdefault(key, []).append(i)
        self.index = {key: np.array(where, dtype=np.int64) for key, where in positions.items()}

    def __getstate__(self) -> dict[str, Any]:  # `index` is derived: not pickled
        return {"keys": self.keys, "allocated": self.allocated, "categories": self.categories,
                "reserve_ratio": self.reserve_ratio, "post_bytes": self.post_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.__post_init__()

    def peaks(self, phases: list[Phase]) -> dict[tuple[Phase, str], PhasePeak]:
        """The peak of every (phase, segment) of `phases` (zero where a segment has no point)."""
        best: dict[tuple[Phase, str], int] = {}
        for i, (phase, segment, _micro, _block) in enumerate(self.keys):
            key = (phase, segment)
            if phase in phases and (key not in best or self.allocated[i] > self.allocated[best[key]]):
                best[key] = i
        out: dict[tuple[Phase, str], PhasePeak] = {}
        for key, i in best.items():
            peak = PhasePeak.from_vector(self.allocated[i], self.categories[i])
            peak.reserved = round(peak.allocated * self.reserve_ratio)
            out[key] = peak
        for phase in phases:
            for segment in SEGMENTS:
                out.setdefault((phase, segment), PhasePeak.from_vector(0, [0] * len(TENSOR_CATEGORIES)))
        return out


def curves_of(trace: Trace) -> Curves:
    """Replay the events through the allocator model, recording the curve after each allocation."""
    allocator = CachingAllocator()
    blocks: dict[int, Any] = {}
    index = {c: j for j, c in enumerate(TENSOR_CATEGORIES)}
    transient = {index[MemoryCategory.ACTIVATIONS], index[MemoryCategory.TEMPORARY]}
    made_in_post: set[int] = set()
    current = [0] * len(TENSOR_CATEGORIES)
    keys: list[tuple[Phase, str, int, int]] = []
    totals: list[int] = []
    rows: list[list[int]] = []
    post: list[int] = []
    live = post_live = 0
    for event in trace.events:
        allocation = trace.allocations[event.alloc_id]
        if allocation.host:
            continue
        category = index[allocation.category]
        if event.nbytes > 0:
            blocks[event.alloc_id] = allocator.malloc(event.nbytes, allocation.stream)
            size = round_size(event.nbytes)
            current[category] += size
            live += size
            if event.segment == "post" and category in transient:
                made_in_post.add(event.alloc_id)
                post_live += size
            keys.append((event.phase, event.segment, event.micro_step, event.block))
            totals.append(live)
            rows.append(list(current))
            post.append(post_live)
        else:
            block = blocks.pop(event.alloc_id, None)
            if block is not None:
                size = round_size(-event.nbytes)
                current[category] -= size
                live -= size
                if event.alloc_id in made_in_post:
                    made_in_post.discard(event.alloc_id)
                    post_live -= size
                allocator.free(block)
    return Curves(
        keys=keys,
        allocated=np.asarray(totals, dtype=np.float64),
        categories=np.asarray(rows, dtype=np.float64).reshape(len(rows), len(TENSOR_CATEGORIES)),
        reserve_ratio=max(1.0, allocator.peak_reserved / max(max(totals, default=0), 1)),
        post_bytes=np.asarray(post, dtype=np.float64),
    )


@dataclass(frozen=True, slots=True)
class RankEvents:
    """What the trace of one rank of an FSDP step keeps to be carried to another world size (`trace.depth.worlds`)."""

    world: int
    """The world size it was traced at."""
    rows_divisor: int
    """The greatest common divisor of the rows (dim 0) of every parameter FSDP shards: at a world size that
    divides it, every shard is even (no padding)."""
    trace: Trace
    """The allocations and events, without the ops."""
    states: tuple[int, ...] = ()
    """Bytes of each storage of the optimizer state on the device (the static bytes, before the allocator rounds
    them)."""


@dataclass(kw_only=True, slots=True)
class StepTrace:
    """What one traced part of a step, at one depth and batch size, came to."""

    phases: list[Phase]
    """The phases of the step this trace covers, in order."""
    curves: Curves
    """The allocation curve, for extrapolation in depth and batch size."""
    ops: tuple[Signature, ...]
    """The cost signature of every op of one micro-batch (passes) or the optimizer step, in order."""
    parameters: int
    trainable_parameters: int
    op_count: int
    static_bytes: dict[MemoryCategory, int] = dataclasses.field(default_factory=dict)
    """Bytes alive through the whole step that the trace made at set-up (optimizer state)."""
    offloaded_bytes: int = 0
    """Bytes one micro-batch copies to the host and back (`Trace.offloaded_bytes`)."""
    first_micro_batch: StepTrace | None = None
    """Passes of two micro-batches: the trace of the first alone, which is what a step of one
    micro-batch traces (the same events up to the second's start, the same ops)."""
    rank: RankEvents | None = None
    """An FSDP trace's events, to derive the same step at another world size from (None for any other)."""
    events: Trace | None = None
    """The passes' allocations and events (no ops) of a trace on one device, to derive the same passes at another
    sequence length from (`trace.depth.lengths`); None for an optimizer step, a rank of FSDP and a derived trace."""

    def peaks(self) -> dict[tuple[Phase, str], PhasePeak]:
        """The peak of every (phase, segment) of the traced phases."""
        return self.curves.peaks(self.phases)
