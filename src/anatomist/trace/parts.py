"""Which traces a step needs and where they come from: the trace cache, forked workers, or this process.

`trace_part` is what the estimator asks for: one part of a recipe's step at a depth and batch
size, served from the cache (`cache`, keyed by `keys.part_key`) or traced (`driver.trace_step`).
`trace_parts` first puts every part a caller will ask for into the cache, traced side by side in
forked processes (`pool`). Nothing here imports torch until a part must really be traced.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from anatomist.trace import cache, pool
from anatomist.trace.keys import Cut, Depth, Part, part_key, traced_micro_batches
from anatomist.trace.records import StepTrace

if TYPE_CHECKING:
    from anatomist.recipe import ResolvedRecipe
    from anatomist.workload import Workload

PartRequest = tuple["ResolvedRecipe", Part, Depth, int, int]
"""A part of a recipe's step at a depth and batch size, on a number of data-parallel devices (only an
FSDP recipe's trace depends on it: `keys.traced_world`): what `trace_part` is asked for."""


def trace_part(workload: Workload, recipe: ResolvedRecipe, part: Part, *, depth: Depth, batch_size: int,
               compute_capability: str, use_cache: bool = True, num_gpus: int = 1) -> StepTrace:
    """The fake-tensor trace of one part of a step (see `driver.trace_step`), with its ops recorded.

    Served from the trace cache (memory, then disk: `trace.cache`) when the same part was
    traced before with everything that shapes it equal (`keys.part_key`).
    """
    request = (recipe, part, depth, batch_size, num_gpus)
    if not use_cache:
        return dataclasses.replace(trace_request(workload, request, compute_capability), first_micro_batch=None)
    return cache.get_or_trace(part_key(workload, recipe, part, depth, batch_size, compute_capability, num_gpus),
                              lambda: _keep_first_micro_batch(workload, request, compute_capability,
                                                              trace_request(workload, request, compute_capability)))


def trace_parts(workload: Workload, requests: Iterable[PartRequest], compute_capability: str) -> None:
    """Put into the trace cache the parts `requests` name that it lacks, traced side by side in forked
    processes (`trace.pool`). Where they cannot be (one core, not Linux, a job that failed), nothing
    is stored: `trace_part` traces each when asked, in this process. The passes of one micro-batch
    are not traced where those of two are: they are the first of the two."""
    wanted: dict[tuple[Any, ...], PartRequest] = {}
    derived: set[tuple[Any, ...]] = set()
    for request in requests:
        recipe, part, depth, batch, num_gpus = request
        key = part_key(workload, recipe, part, depth, batch, compute_capability, num_gpus)
        if key in wanted or cache.has(key):
            continue
        wanted[key] = request
        if part == "forward-backward" and recipe.gradient_accumulation_steps > 1 and recipe.fsdp == "none":
            derived.add(_first_micro_batch_key(workload, request, compute_capability))
    jobs = sorted(((key, request) for key, request in wanted.items() if key not in derived),
                  key=lambda job: -_size_guess(job[1]))  # the longest first: no long job left for the end
    work = [functools.partial(trace_request, workload, request, compute_capability) for _, request in jobs]
    for index, trace in pool.run_all(work):
        if trace is not None:
            key, request = jobs[index]
            cache.put(key, _keep_first_micro_batch(workload, request, compute_capability, trace))


def trace_request(workload: Workload, request: PartRequest, compute_capability: str) -> StepTrace:
    """The trace of `request`, with its ops recorded: what `trace_part` stores, and a worker's job
    (module level, so that it pickles)."""
    from anatomist.trace.driver import trace_step  # imports torch: only when something is traced

    recipe, part, depth, batch, num_gpus = request
    return trace_step(workload, recipe, depth=depth, batch_size=batch, compute_capability=compute_capability,
                      part=part, record_ops=True, num_gpus=num_gpus)


def _size_guess(request: PartRequest) -> float:
    """How long a part takes to trace, roughly (its ops): blocks, micro-batches, recomputation."""
    recipe, part, depth, _, _ = request
    blocks = depth if isinstance(depth, int) else depth.blocks if isinstance(depth, Cut) else 100
    if part == "optimizer":
        return blocks
    return 2 * blocks * traced_micro_batches(recipe, part) * (1.5 if recipe.gradient_checkpointing else 1)


def _first_micro_batch_key(workload: Workload, request: PartRequest, compute_capability: str) -> tuple[Any, ...]:
    recipe, part, depth, batch, num_gpus = request
    one = dataclasses.replace(recipe, gradient_accumulation_steps=1)
    return part_key(workload, one, part, depth, batch, compute_capability, num_gpus)


def _keep_first_micro_batch(workload: Workload, request: PartRequest, compute_capability: str,
                            traced: StepTrace) -> StepTrace:
    """Store the passes of one micro-batch that a trace of two holds under their own key; the trace without them."""
    if traced.first_micro_batch is None:
        return traced
    cache.put(_first_micro_batch_key(workload, request, compute_capability), traced.first_micro_batch)
    return dataclasses.replace(traced, first_micro_batch=None)
