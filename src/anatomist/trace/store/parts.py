"""Which traces a step needs and where they come from: the trace cache, forked workers, or this process.

`trace_part` is what the estimator asks for: one part of a recipe's step at a depth and batch
size, served from the cache (`cache`, keyed by `keys.part_key`) or traced (`driver.trace_step`).
`trace_parts` first puts every part a caller will ask for into the cache, traced side by side in
forked processes (`pool`). Within `worlds_derived_from(a, b)`, a rank of FSDP at another world size is
derived from its traces at worlds a and b, and its passes at b and one batch size from those at a and the batch
size below (`trace.depth.worlds`); traced only where they cannot be. Within `lengths_derived_from(a, b, c)`, or where
such a block with `keep` kept those three lengths for the part, a part on one device at another sequence length is
derived from its traces at a, b and c (`trace.depth.lengths`), never stored. Nothing here imports torch until a
part must really be traced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anatomist.trace.depth.cuts import Cut, Depth
from anatomist.trace.depth.lengths import derive_length
from anatomist.trace.engine.records import StepTrace
from anatomist.trace.store import cache, pool
from anatomist.trace.store.keys import Part, compile_context, part_key, traced_compile, traced_micro_batches

if TYPE_CHECKING:
    from anatomist.recipe import ResolvedRecipe
    from anatomist.workload import Workload

@dataclass(frozen=True, slots=True)
class PartRequest:
    """A part of a recipe's step at a depth and batch size, on a number of data-parallel devices: what `trace_part`
    is asked for."""

    recipe: ResolvedRecipe
    part: Part
    depth: Depth
    batch_size: int
    num_gpus: int = 1
    """Data-parallel devices: only an FSDP recipe's trace depends on it (`keys.traced_world`)."""

    def key(self, workload: Workload, compute_capability: str) -> tuple[Any, ...]:
        """The trace cache's key of this part (`keys.part_key`)."""
        return part_key(workload, self.recipe, self.part, self.depth, self.batch_size, compute_capability,
                        self.num_gpus)

    def replace(self, **changes: Any) -> PartRequest:
        return dataclasses.replace(self, **changes)


def trace_part(workload: Workload, recipe: ResolvedRecipe, part: Part, *, depth: Depth, batch_size: int,
               compute_capability: str, use_cache: bool = True, num_gpus: int = 1) -> StepTrace:
    """The fake-tensor trace of one part of a step (see `driver.trace_step`), with its ops recorded.

    Served from the trace cache (memory, then disk: `trace.store.cache`) when the same part was
    traced before with everything that shapes it equal (`keys.part_key`).
    """
    request = _as_traced(workload, PartRequest(recipe, part, depth, batch_size, num_gpus))
    if not use_cache:
        return dataclasses.replace(trace_request(workload, request, compute_capability), first_micro_batch=None)
    lengths = _length_basis(workload, request, compute_capability)
    derived = _derived_length(workload, request, lengths, compute_capability) if lengths else None
    if derived is not None:
        return derived

    def traced() -> StepTrace:
        return _derived(workload, request, compute_capability) or _keep_first_micro_batch(
            workload, request, compute_capability, trace_request(workload, request, compute_capability))

    return cache.get_or_trace(request.key(workload, compute_capability), traced)


def trace_parts(workload: Workload, requests: Iterable[PartRequest], compute_capability: str) -> None:
    """Put into the trace cache the parts `requests` name that it lacks, traced side by side in forked
    processes (`trace.store.pool`). Where they cannot be (one core, not Linux, a job that failed), nothing
    is stored: `trace_part` traces each when asked, in this process. The passes of one micro-batch
    are not traced where those of two are: they are the first of the two. Within `worlds_derived_from`,
    what can be derived from the others is derived once they are traced (`_basis_requests`)."""

    def key_of(request: PartRequest) -> tuple[Any, ...]:
        return request.key(workload, compute_capability)

    needed: dict[tuple[Any, ...], PartRequest] = {}
    """Each part to put in the cache, and those it is derived from at other world sizes."""
    at_lengths: dict[tuple[int, int, int], list[PartRequest]] = {}
    """The parts derived from other sequence lengths, by those lengths: those are traced instead."""
    for request in (_as_traced(workload, r) for r in requests):
        lengths = _length_basis(workload, request, compute_capability)
        if lengths:
            at_lengths.setdefault(lengths, []).append(request)
            continue
        for one in (*_basis_requests(workload, request), request):
            key = key_of(one)
            if key not in needed and not cache.has(key):
                needed[key] = one
    carried = {key: request for key, request in needed.items()
               if _basis_requests(workload, request, lambda r: key_of(r) in needed or cache.has(key_of(r)))}
    first_micro_batches = {_first_micro_batch_key(workload, r, compute_capability) for r in needed.values()
                           if r.part == "forward-backward" and r.recipe.gradient_accumulation_steps > 1
                           and r.recipe.fsdp == "none"}
    _side_by_side(workload, {k: r for k, r in needed.items() if k not in carried and k not in first_micro_batches},
                  compute_capability)
    left = {}
    for key, request in sorted(carried.items(), key=lambda item: (item[1].num_gpus != _bases[-1][1], item[1].batch_size)):
        trace = _derived(workload, request, compute_capability)  # world b's first: the other sizes derive from them
        if trace is not None:
            cache.put(key, trace)
        else:
            left[key] = request
    _side_by_side(workload, left, compute_capability)
    for basis, derived in at_lengths.items():
        for length in basis:
            trace_parts(at_length(workload, length), derived, compute_capability)


def _as_traced(workload: Workload, request: PartRequest) -> PartRequest:
    """`request` as it is traced. Checkpointing one layer in N (`Recipe.checkpoint_every`: `stack.CHECKPOINTED` makes
    them kinds of their own) cuts a model whose layers are otherwise alike (one ModuleList) to layers that differ only
    in which of them checkpoint. So a cut's

    - optimizer step, which reads only the parameters, steps as the model cut to as many layers does, and shares that
      trace with every recipe that checkpoints otherwise;
    - passes depend only on which of its layers checkpoint, in order, not on their numbers in the full model or on N:
      they are traced as the cut of the same length that checkpoints the same ones of its layers under one in two
      (`_one_in_two`), and recipes that checkpoint one layer in 2, 3 or 4 share those traces."""
    recipe, depth = request.recipe, request.depth
    if not isinstance(depth, Cut) or recipe.checkpoint_every == 1:
        return request
    from anatomist.trace.depth.plan import model_plan  # from the cache, else the model built on the meta device

    plain = model_plan(workload, recipe.replace(checkpoint_every=1)).plan
    if plain.how != "uniform":
        return request
    if request.part == "optimizer":
        return request.replace(depth=depth.blocks)
    one_in_two = _one_in_two(recipe, depth) if len(plain.deltas[0].inserted) == 1 else None
    return request.replace(recipe=recipe.replace(checkpoint_every=2), depth=one_in_two) if one_in_two else request


def _one_in_two(recipe: ResolvedRecipe, cut: Cut) -> Cut | None:
    """The cut of one stack that keeps as many layers as `cut` and, where one layer in two checkpoints, checkpoints the
    same ones of them as `recipe` checkpoints of `cut`'s: each kept layer the next one after the last of the right
    parity. None where that runs past the stack's depth."""
    (stack,) = cut.stacks
    kept: list[int] = []
    for layer in stack.kept:
        after = kept[-1] + 1 if kept else 0
        kept.append(after if (after % 2 == 0) == recipe.checkpointed(layer) else after + 1)
    if kept[-1] >= stack.depth:
        return None
    return Cut(stacks=(dataclasses.replace(stack, kept=tuple(kept)),))


def _side_by_side(workload: Workload, wanted: dict[tuple[Any, ...], PartRequest], compute_capability: str) -> None:
    """Trace `wanted` (by their keys) in forked workers, into the cache. The passes of a compiled recipe at one batch
    size and several depths are one job: the worker compiles the blocks once for all of them (`trace.step.compiled`)."""
    groups: dict[Any, list[tuple[tuple[Any, ...], PartRequest]]] = {}
    for key, request in wanted.items():
        shared = request.part == "forward-backward" and traced_compile(request.recipe)
        group = (compile_context(workload, request.recipe), request.batch_size, request.num_gpus) if shared else key
        groups.setdefault(group, []).append((key, request))
    # the longest first: no long job left for the end
    jobs = sorted(groups.values(), key=lambda job: -sum(_size_guess(r) for _, r in job))
    work = [functools.partial(trace_requests, workload, [r for _, r in job], compute_capability) for job in jobs]
    for index, traces in pool.run_all(work):
        if traces is not None:
            for (key, request), trace in zip(jobs[index], traces, strict=True):
                cache.put(key, _keep_first_micro_batch(workload, request, compute_capability, trace))


_bases: list[tuple[int, int]] = []
"""The two world sizes of the innermost `worlds_derived_from` block."""


@contextlib.contextmanager
def worlds_derived_from(lo: int, hi: int) -> Iterator[None]:
    """Within the block, a rank of FSDP at a world size other than `lo` and `hi` is derived from the traces of the
    same part at those two (`trace.depth.worlds.derive`), which are traced where the cache lacks them, and its passes at
    `hi` and the larger batch size from those at `lo` (`trace.depth.worlds.derive_batch`) where those are traced anyway;
    traced itself only where it cannot be derived. For a caller that will trace FSDP at several world sizes
    (`plan --max-nodes`)."""
    _bases.append((lo, hi))
    try:
        yield
    finally:
        _bases.pop()


def _basis_requests(workload: Workload, request: PartRequest,
                    available: Callable[[PartRequest], bool] | None = None) -> list[PartRequest]:
    """The requests `request` is derived from within the innermost `worlds_derived_from(a, b)` block; [] where it is
    traced itself (outside a block, not FSDP, at world a, or at b where `available` lacks what it needs):

    - at world b and batch s + 1: the same passes at (a, s), (a, s + 1) and (b, s) (`worlds.derive_batch`), where
      `available` has all three (so that nothing is traced for it that would not be) and s is 2 or more (at one
      sample some copies are views: `estimate.traces.TRACE_BATCHES`);
    - at any other world size: the same part at a and b (`worlds.derive`), unless the shards would be padded at
      one of the three."""
    recipe, batch = request.recipe, request.batch_size
    if not _bases or recipe.fsdp == "none" or request.num_gpus == _bases[-1][0]:
        return []
    lo, hi = _bases[-1]
    if request.num_gpus == hi:
        basis = [request.replace(batch_size=batch - 1, num_gpus=lo), request.replace(num_gpus=lo),
                 request.replace(batch_size=batch - 1)]
        passes = request.part in ("forward-backward", "inference") and batch - 1 >= 2
        return basis if passes and available is not None and all(map(available, basis)) else []
    from anatomist.trace.depth.plan import model_plan  # from the cache, else the model built on the meta device

    rows = model_plan(workload, recipe).size.rows_divisor
    if any(rows % n for n in (lo, hi, request.num_gpus)):
        return []
    return [request.replace(num_gpus=n) for n in (lo, hi)]


def _derived(workload: Workload, request: PartRequest, compute_capability: str) -> StepTrace | None:
    """The trace of `request` derived from those `_basis_requests` names (those at world a and b traced where the
    cache lacks them; at world b only from what it holds), or None where it is traced itself or cannot be derived."""
    from anatomist.trace.depth.worlds import derive, derive_batch

    def cached(one: PartRequest) -> bool:
        return cache.has(one.key(workload, compute_capability))

    basis = _basis_requests(workload, request, cached)
    if not basis:
        return None
    traces = [trace_part(workload, r.recipe, r.part, depth=r.depth, batch_size=r.batch_size,
                         compute_capability=compute_capability, num_gpus=r.num_gpus) for r in basis]
    if request.num_gpus == _bases[-1][1]:
        lo, lo_next, other = traces
        return derive_batch(lo, lo_next, other)
    lo, hi = traces
    return derive(lo, hi, request.num_gpus)


def trace_request(workload: Workload, request: PartRequest, compute_capability: str) -> StepTrace:
    """The trace of `request`, with its ops recorded: what `trace_part` stores."""
    from anatomist.trace.step.driver import trace_step  # imports torch: only when something is traced

    return trace_step(workload, request.recipe, depth=request.depth, batch_size=request.batch_size,
                      compute_capability=compute_capability, part=request.part, record_ops=True,
                      num_gpus=request.num_gpus)


def trace_requests(workload: Workload, requests: list[PartRequest], compute_capability: str) -> list[StepTrace]:
    """`trace_request` of each of `requests`, in order: a worker's job (module level, so that it pickles)."""
    return [trace_request(workload, request, compute_capability) for request in requests]


def _size_guess(request: PartRequest) -> float:
    """How long a part takes to trace, roughly (its ops): blocks, micro-batches, recomputation."""
    recipe, part, depth = request.recipe, request.part, request.depth
    blocks = depth if isinstance(depth, int) else depth.blocks if isinstance(depth, Cut) else 100
    if part == "optimizer":
        return blocks
    return 2 * blocks * traced_micro_batches(recipe, part) * (1.5 if recipe.gradient_checkpointing else 1)


def _first_micro_batch_key(workload: Workload, request: PartRequest, compute_capability: str) -> tuple[Any, ...]:
    one = dataclasses.replace(request.recipe, gradient_accumulation_steps=1)
    return request.replace(recipe=one).key(workload, compute_capability)


def _keep_first_micro_batch(workload: Workload, request: PartRequest, compute_capability: str,
                            traced: StepTrace) -> StepTrace:
    """Store the passes of one micro-batch that a trace of two holds under their own key; the trace without them."""
    if traced.first_micro_batch is None:
        return traced
    cache.put(_first_micro_batch_key(workload, request, compute_capability), traced.first_micro_batch)
    return dataclasses.replace(traced, first_micro_batch=None)


LengthsKey = tuple[Any, ...]
"""The key under which a part's three lengths are kept: ("lengths", its key at no length)."""
_lengths: list[tuple[tuple[int, int, int], set[LengthsKey]]] = []
"""The three sequence lengths of each `lengths_derived_from` block, innermost last, and the parts derived in it."""
_DERIVED_LENGTHS = cache.Memo(1024)
"""Parts derived from other sequence lengths, by their key and those lengths: never stored on disk."""
_KEPT = cache.Memo(4096)
"""What a `lengths_derived_from(..., keep=True)` block stored for a part (by the part's key), or None."""


@dataclass(frozen=True, slots=True)
class LengthBasis:
    """What a `lengths_derived_from(..., keep=True)` block stores for each part it derived: the three lengths."""

    lengths: tuple[int, int, int]


@contextlib.contextmanager
def lengths_derived_from(lengths: tuple[int, int, int], *, keep: bool = False) -> Iterator[None]:
    """Within the block, a part on one device at a sequence length other than `lengths` is derived from the same part
    at those three (traced where the cache lacks them: `trace.depth.lengths.derive_length`), where it can be
    (`derivable_in_length`); traced itself where the derivation is refused. For a search over lengths
    (`estimate.longest`), which checks its answer against a direct trace, then, with `keep`, keeps in the trace cache
    that the parts derived in the block are derived from `lengths` at any length: a later estimate of the recipe at
    another length then derives them without tracing (and without a block)."""
    derived: set[LengthsKey] = set()
    _lengths.append((lengths, derived))
    try:
        yield
    finally:
        _lengths.pop()
    if keep:
        for key in derived:
            cache.put(key, LengthBasis(lengths))
        _KEPT.clear()


def derivable_in_length(workload: Workload, recipe: ResolvedRecipe) -> bool:
    """Whether the parts of `recipe` may be derived from other sequence lengths: one device's passes, whose sizes are
    polynomials in the length. Not a split or sharded rank (its events go to other world sizes), compiled blocks
    (inductor's choices follow the sizes), Liger's and Cut Cross-Entropy's chunks (a power of two of tokens),
    a Mixture of Experts (tokens routed in whole numbers), the data's own lengths (padding-free, packing), or a
    preference loss's prompt (a length of its own)."""
    return (recipe.fsdp == "none" and recipe.tp_size == recipe.cp_size == recipe.sp_size == recipe.ep_size == 1
            and not (traced_compile(recipe) or recipe.use_liger_kernel or recipe.cut_cross_entropy
                     or recipe.padding_free or recipe.packing or workload.is_moe or workload.prompt_len))


def at_length(workload: Workload, length: int) -> Workload:
    """`workload` at `length` tokens per sample."""
    return dataclasses.replace(workload, seq_len=length)


def _lengths_key(workload: Workload, request: PartRequest, compute_capability: str) -> LengthsKey:
    return ("lengths", *request.key(at_length(workload, 0), compute_capability))


def _length_basis(workload: Workload, request: PartRequest, compute_capability: str) -> tuple[int, int, int] | None:
    """The three lengths `request` is derived from (the innermost block's, else those a block kept for it), or None
    where it is traced at its own length."""
    if request.part == "optimizer" or not derivable_in_length(workload, request.recipe):
        return None  # an optimizer step is the same trace at every length (`keys.part_key`)
    lengths = _lengths[-1][0] if _lengths else None
    if lengths is None:  # asked for every part looked up: the lengths' own key is made on a miss only
        kept = _KEPT.get(request.key(workload, compute_capability),
                         lambda: cache.find(_lengths_key(workload, request, compute_capability), LengthBasis))
        lengths = kept.lengths if kept is not None else None
    return lengths if lengths is not None and workload.seq_len not in lengths else None


def _derived_length(workload: Workload, request: PartRequest, lengths: tuple[int, int, int],
                    compute_capability: str) -> StepTrace | None:
    """`request` derived from its traces at `lengths` (`derive_length`), or None where it cannot be."""

    def derived() -> StepTrace | None:
        traces = [trace_part(at_length(workload, n), request.recipe, request.part, depth=request.depth,
                             batch_size=request.batch_size, compute_capability=compute_capability,
                             num_gpus=request.num_gpus) for n in lengths]
        return derive_length(traces, lengths, workload.seq_len)

    trace = _DERIVED_LENGTHS.get((request.key(workload, compute_capability), lengths), derived)
    if trace is not None and _lengths:
        _lengths[-1][1].add(_lengths_key(workload, request, compute_capability))
    return trace
