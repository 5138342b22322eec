"""A step's trace at a sequence length never traced, from its traces at three others (`derive_length`).

Fake tensors make a trace's cost the number of its ops, not their sizes, so a trace at 131,072 tokens costs what
one at 512 does, and every new length is a new trace. Where the step runs the same ops in the same order at
every length (the same allocations, made and freed alike: `worlds.paired`), the size of each tensor is a product
of its dimensions, at most two of which grow with the sequence (an attention's scores or mask, sequence x sequence),
the others fixed by the model: a polynomial of degree two or less in the length. So are an op's FLOPs and bytes
(`Signature.costs`; a product's rows, columns and batch each affine in the length). Three traces at lengths a, b, c
give each of them at any length n exactly, through the quadratic that passes through the three:

    f(n) = f(a) (n - b)(n - c) / ((a - b)(a - c)) + f(b) (n - a)(n - c) / ((b - a)(b - c))
         + f(c) (n - a)(n - b) / ((c - a)(c - b))

worked in whole numbers, with the check that each result is one (a size that is not polynomial in the length, as a
kernel that pads to a multiple, leaves a fraction at some length: that trace is refused). The derived allocations
replay through the same allocator model as a trace's (`records.curves_of`), so the reserve is that of the step at
n, not a ratio carried over.

What the estimator traces is a cut of the model at two batch sizes; each of those parts is derived on its own. A
derivation is refused (None: the caller traces the length) where the three traces do not line up allocation by
allocation and op by op, where a result is not a whole non-negative number, and for what is not one device's
passes (`StepTrace.events`: an FSDP rank's are carried to other world sizes, not lengths; an optimizer step is the
same trace at every length). What is derived is never
stored: `trace.store.parts` computes it from the three each time, and the caller that chose the three lengths
checks one derived answer against a direct trace (`estimate.longest`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from anatomist.trace.depth.worlds import paired, resized, to_last_allocation
from anatomist.trace.engine.records import Allocation, Event, Signature, StepTrace, Trace, curves_of

LENGTH_STEP = 128
"""The lengths a search tries are multiples of this (tokens)."""


def quadratic_at(values: Sequence[int], lengths: Sequence[int], n: int) -> int | None:
    """The value at `n` of the quadratic through (lengths[i], values[i]), three of each; None where it is no whole
    number."""
    (a, b, c), (fa, fb, fc) = lengths, values
    denominator = (a - b) * (a - c) * (b - c)
    numerator = (fa * (n - b) * (n - c) * (b - c) - fb * (n - a) * (n - c) * (a - c)
                 + fc * (n - a) * (n - b) * (a - b))
    value, rest = divmod(numerator, denominator)
    return value if rest == 0 else None


def kept_events(allocations: dict[int, Allocation], events: list[Event]) -> Trace:
    """The events that move bytes up to the last allocation, the frees between two allocations in the order of their
    allocations (the collector frees them in any), and the allocations they make: what a curve's points read
    (`records.curves_of`), the same for a micro-batch traced alone as for the first of two."""
    kept: list[Event] = []
    frees: list[Event] = []
    for event in to_last_allocation(Trace(allocations=allocations, events=events)):
        if event.nbytes < 0:
            frees.append(event)
            continue
        kept += sorted(frees, key=lambda free: free.alloc_id)
        frees = []
        kept.append(event)
    return Trace(allocations={e.alloc_id: allocations[e.alloc_id] for e in kept if e.nbytes > 0}, events=kept)


def derive_length(traces: Sequence[StepTrace], lengths: Sequence[int], length: int) -> StepTrace | None:
    """The trace of the same part as `traces` (three, at `lengths` tokens per sample) at `length` tokens; None where
    it cannot be derived exactly (module docstring)."""
    first = traces[0]
    same = [(t.phases, t.parameters, t.trainable_parameters, t.op_count, t.static_bytes) for t in traces]
    if len(traces) != 3 or len(set(lengths)) != 3 or same.count(same[0]) != 3:
        return None
    if first.first_micro_batch is not None:
        return None  # the cache keeps a step's first micro-batch under its own key (`parts._keep_first_micro_batch`)
    events = [t.events for t in traces if t.events is not None]
    if len(events) != 3:
        return None  # an FSDP rank's (`StepTrace.rank`) or an optimizer step's
    trace = _derived_events(events, lengths, length)
    ops = _derived_ops(traces, lengths, length)
    offloaded = quadratic_at([t.offloaded_bytes for t in traces], lengths, length)
    if trace is None or ops is None or offloaded is None or offloaded < 0:
        return None
    return dataclasses.replace(first, curves=curves_of(trace), ops=ops, offloaded_bytes=offloaded, events=trace)


def _derived_events(events: Sequence[Trace], lengths: Sequence[int], length: int) -> Trace | None:
    """The allocations of the three traces, paired, each at `length`; None where they do not pair or a size is no
    whole non-negative number."""
    mid, high = paired(events[0], events[1]), paired(events[0], events[2])
    if mid is None or high is None or mid.keys() != high.keys():
        return None
    sizes = {}
    for alloc_id in mid:
        values = [events[0].allocations[alloc_id].nbytes, events[1].allocations[mid[alloc_id]].nbytes,
                  events[2].allocations[high[alloc_id]].nbytes]
        size = quadratic_at(values, lengths, length)
        if size is None or size < 0:
            return None
        sizes[alloc_id] = size
    return resized(events[0], sizes)


def _derived_ops(traces: Sequence[StepTrace], lengths: Sequence[int], length: int) -> tuple[Signature, ...] | None:
    """Each op of the three traces, lined up, at `length`; None where they do not line up or a cost is no whole
    non-negative number."""
    ops = [t.ops for t in traces]
    if len({len(o) for o in ops}) != 1:
        return None
    derived = []
    for a, b, c in zip(*ops, strict=True):
        if not a.kind() == b.kind() == c.kind():
            return None
        costs = []
        for values in zip(a.costs(), b.costs(), c.costs(), strict=True):
            cost = quadratic_at(values, lengths, length)
            if cost is None or cost < 0:
                return None
            costs.append(cost)
        derived.append(a.with_costs(*costs))
    return tuple(derived)
