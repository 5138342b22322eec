"""One rank of an FSDP step at a world size never traced, from its traces at two others (`derive`).

What a rank of FSDP2 allocates at world size N is, tensor by tensor, either independent of N (the
activations, the unsharded parameters of the units in flight, the all-gather outputs and the reduce-scatter
inputs) or 1/N of the whole (its shards of the parameters, gradients and optimizer state, the all-gather
inputs, the reduce-scatter outputs), as long as no shard is padded: FSDP2 pads a parameter's rows to a
multiple of N. The step runs the same ops in the same order at every N. So where the rows of every sharded
parameter divide by the three world sizes (`RankEvents.rows_divisor`), the bytes of each allocation are
affine in 1/N, and two traces (at worlds a and b) give every allocation's bytes at N exactly:

    bytes(N) = bytes(a) + (bytes(b) - bytes(a)) x (1/N - 1/a) / (1/b - 1/a)

The derived events replay through the same allocator model as a trace's (`records.curves_of`). A derivation
is refused (None: the caller traces N) where the shards would be padded, where the two traces do not make
the same allocations in the same order, or where a derived size is not a whole number of bytes. A derived
trace keeps no op costs: the time model reads one device's traces, never a rank's (`keys.one_device`).

The batch size moves a rank's bytes the other way: the activations grow with each sample, the shards and the
unsharded parameters do not. So what one more sample adds to each allocation is the same at every world size, and
the passes at world b and batch s + 1 are those at batch s plus what the sample adds at world a (`derive_batch`):
three traces where four were taken. This holds with padded shards too (padding is not per sample).

`plan --max-nodes` traces FSDP at the two smallest world sizes it plans and derives the larger ones
(`plan.clusters`): the traces of a 16-GPU rank cost as much as those of a 2-GPU one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from anatomist.anatomy import MemoryCategory
from anatomist.trace.engine.allocator import round_size
from anatomist.trace.engine.records import Allocation, Event, RankEvents, StepTrace, Trace, curves_of


def derive(lo: StepTrace, hi: StepTrace, world: int) -> StepTrace | None:
    """The trace of the same part of the same step as `lo` and `hi` (one rank of FSDP at two world sizes), at
    `world`; None where it cannot be derived exactly (module docstring)."""
    if lo.rank is None or hi.rank is None or lo.rank.world == hi.rank.world:
        return None
    a, b = lo.rank.world, hi.rank.world
    if any(lo.rank.rows_divisor % n or hi.rank.rows_divisor % n for n in (a, b, world)):
        return None  # padded shards: not a whole part of the unsharded bytes
    if (lo.phases, lo.parameters, lo.trainable_parameters, lo.op_count) != \
            (hi.phases, hi.parameters, hi.trainable_parameters, hi.op_count):
        return None
    pairs = paired(lo.rank.trace, hi.rank.trace)
    if pairs is None or len(lo.rank.states) != len(hi.rank.states) or not all(map(_states_are_static, (lo, hi))):
        return None
    allocated = _each_at([(lo.rank.trace.allocations[mine].nbytes, hi.rank.trace.allocations[theirs].nbytes)
                          for mine, theirs in pairs.items()], a, b, world)
    states = _each_at(list(zip(lo.rank.states, hi.rank.states, strict=True)), a, b, world)
    if allocated is None or states is None:
        return None
    trace = resized(lo.rank.trace, dict(zip(pairs, allocated, strict=True)))
    static = {MemoryCategory.OPTIMIZER_STATES: sum(map(round_size, states))} if lo.static_bytes else {}
    return StepTrace(phases=list(lo.phases), curves=curves_of(trace), ops=(), parameters=lo.parameters,
                     trainable_parameters=lo.trainable_parameters, op_count=lo.op_count, static_bytes=static,
                     rank=RankEvents(world=world, rows_divisor=lo.rank.rows_divisor, trace=trace, states=tuple(states)))


def derive_batch(lo: StepTrace, lo_next: StepTrace, other: StepTrace) -> StepTrace | None:
    """The trace of the same passes as `other` (one rank of FSDP) at the batch size of `lo_next`, where `lo` and
    `lo_next` are those passes at another world size and two batch sizes (`lo`'s that of `other`): each allocation of
    `other` grows by what its pair grows from `lo` to `lo_next` (module docstring). None where the three do not
    make the same allocations in the same order, or a size would be negative."""
    if lo.rank is None or lo_next.rank is None or other.rank is None \
            or lo.rank.world != lo_next.rank.world or lo.rank.world == other.rank.world:
        return None
    same = [(t.phases, t.parameters, t.trainable_parameters, t.op_count, t.static_bytes) for t in (lo, lo_next, other)]
    if same.count(same[0]) != 3 or lo.static_bytes:
        return None  # passes only: an optimizer step is not per sample
    grown, moved = paired(lo.rank.trace, lo_next.rank.trace), paired(lo.rank.trace, other.rank.trace)
    if grown is None or moved is None:
        return None
    allocations = lo.rank.trace.allocations, lo_next.rank.trace.allocations, other.rank.trace.allocations
    sizes = {moved[i]: allocations[2][moved[i]].nbytes + allocations[1][grown[i]].nbytes - allocations[0][i].nbytes
             for i in grown}
    if any(size < 0 for size in sizes.values()):
        return None
    trace = resized(other.rank.trace, sizes)
    return dataclasses.replace(other, curves=curves_of(trace), ops=(), first_micro_batch=None,
                               rank=dataclasses.replace(other.rank, trace=trace))


def _states_are_static(trace: StepTrace) -> bool:
    """Whether the static bytes of `trace` are its optimizer state's storages, as the allocator rounds them."""
    assert trace.rank is not None
    made = sum(map(round_size, trace.rank.states))
    return set(trace.static_bytes) <= {MemoryCategory.OPTIMIZER_STATES} \
        and trace.static_bytes.get(MemoryCategory.OPTIMIZER_STATES, 0) == made


def _each_at(sizes: list[tuple[int, int]], a: int, b: int, world: int) -> list[int] | None:
    """The bytes at `world` of each (bytes at world `a`, bytes at world `b`), affine in 1/world; None where one is
    not a whole, non-negative number."""
    derived = []
    for lo, hi in sizes:
        numerator, denominator = (hi - lo) * b * (a - world), world * (a - b)
        size = lo + numerator // denominator
        if numerator % denominator or size < 0:
            return None
        derived.append(size)
    return derived


def paired(lo: Trace, hi: Trace) -> dict[int, int] | None:
    """Each allocation of `lo` and the allocation of `hi` made in its place (the n-th allocation event of each);
    None where the two do not allocate alike: the same number of events up to the last allocation, each one made in the same phase,
    segment, micro-batch and block, as the same category, on the same side (device or host), and between any two
    allocations the same allocations freed (in whatever order: a point of the curves is read after each
    allocation, and the allocator model reserves only at one)."""
    mine_events, their_events = (to_last_allocation(t) for t in (lo, hi))
    if len(mine_events) != len(their_events):
        return None
    pairs: dict[int, int] = {}
    mine_of: dict[int, int] = {}
    unmatched: dict[int, int] = {}
    """Frees since the last allocation: +1 where lo freed it, -1 where hi freed its pair; cancelled to nothing."""
    for mine, theirs in zip(mine_events, their_events, strict=True):
        if (mine.nbytes > 0) != (theirs.nbytes > 0):
            return None
        if mine.nbytes > 0:
            if unmatched or mine.alloc_id in pairs or theirs.alloc_id in mine_of \
                    or _where(mine, lo.allocations[mine.alloc_id]) != _where(theirs, hi.allocations[theirs.alloc_id]):
                return None
            pairs[mine.alloc_id] = theirs.alloc_id
            mine_of[theirs.alloc_id] = mine.alloc_id
            continue
        for alloc_id, step in ((mine.alloc_id, 1), (mine_of.get(theirs.alloc_id, -1), -1)):
            count = unmatched.get(alloc_id, 0) + step
            if count:
                unmatched[alloc_id] = count
            else:
                del unmatched[alloc_id]
    return pairs if not unmatched else None


def to_last_allocation(trace: Trace) -> list[Event]:
    """The events of `trace` that move bytes, up to its last allocation: what frees the end of a trace (or the
    collector, whenever it runs there) leaves no point on the curves."""
    events = [e for e in trace.events if e.nbytes]
    last = max((i for i, e in enumerate(events) if e.nbytes > 0), default=-1)
    return events[:last + 1]


def _where(event: Event, allocation: Allocation) -> tuple[Any, ...]:
    return (event.phase, event.segment, event.micro_step, event.block, allocation.category, allocation.host,
            allocation.op)


def resized(trace: Trace, sizes: dict[int, int]) -> Trace:
    """`trace` with each allocation's bytes set to `sizes`' (its events' too)."""
    allocations = {i: dataclasses.replace(a, nbytes=sizes.get(i, a.nbytes)) for i, a in trace.allocations.items()}
    events = [dataclasses.replace(e, nbytes=sizes[e.alloc_id] if e.nbytes > 0 else -sizes.get(e.alloc_id, -e.nbytes))
              for e in trace.events if e.nbytes]
    return Trace(allocations=allocations, events=events)
