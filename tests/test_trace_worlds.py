"""A rank of FSDP at one world size derived from its traces at two others (trace/depth/worlds.py).

The derived trace is checked against the trace of the same part at that world size, taken directly: the
same curves point by point (total and per category), the same reserve ratio from the allocator replay, the
same optimizer state; so is a rank's passes at the larger batch size derived from another world size's. This
checks the derivations, not the tracer (which test_fsdp_accuracy.py checks against PyTorch's FSDPMemTracker). The
tiny Llama's rows (hidden 64, 2 key-value heads of 16, vocabulary 1,000) all divide by 8, not by 16: its shards are
even at 2, 4 and 8 ranks and padded at 16.
"""

from __future__ import annotations

import numpy as np
import pytest

from anatomist.anatomy import MemoryCategory, Phase
from anatomist.recipe import Recipe
from anatomist.trace.depth.worlds import derive, derive_batch
from anatomist.trace.engine.records import Allocation, Event, RankEvents, StepTrace, Trace, curves_of
from anatomist.trace.store import parts
from anatomist.workload_loader import load_workload

CC = "8.0"
RECIPES = {
    "fp32 full_shard": Recipe(dtype="float32", fsdp="full_shard"),
    "bf16 shard_grad_op, checkpointing, accumulation": Recipe(dtype="float32", fsdp="shard_grad_op", bf16=True,
                                                              gradient_checkpointing=True, gradient_accumulation_steps=2),
    "LoRA": Recipe(dtype="float32", fsdp="full_shard", bf16=True, peft="lora"),
    "CPU offload": Recipe(dtype="float32", fsdp="full_shard", bf16=True, offload="cpu"),
}
NAMES = [name if name == "fp32 full_shard" else pytest.param(name, marks=pytest.mark.slow) for name in RECIPES]
"""The recipes each test takes: one in the default run (a test file's budget), all with the slow tests."""


def _traced(workload, recipe, part, world, batch=2):
    return parts.trace_request(workload, parts.PartRequest(recipe, part, 2, batch if part != "optimizer" else 1, world), CC)


def _assert_same_rank(got, want):
    assert got.curves.keys == want.curves.keys
    np.testing.assert_array_equal(got.curves.allocated, want.curves.allocated)
    np.testing.assert_array_equal(got.curves.categories, want.curves.categories)
    np.testing.assert_array_equal(got.curves.post_bytes, want.curves.post_bytes)
    assert got.curves.reserve_ratio == want.curves.reserve_ratio
    assert got.static_bytes == want.static_bytes
    assert (got.parameters, got.trainable_parameters) == (want.parameters, want.trainable_parameters)


@pytest.mark.parametrize("part", ["forward-backward", "optimizer"])
@pytest.mark.parametrize("name", NAMES)
def test_a_derived_rank_is_the_traced_one(tiny_model, name, part):
    workload = load_workload(str(tiny_model("llama")), seq_len=32)
    recipe = RECIPES[name].resolved(workload)
    lo, hi, direct = (_traced(workload, recipe, part, n) for n in (2, 4, 8))
    derived = derive(lo, hi, 8)
    assert derived is not None
    _assert_same_rank(derived, direct)
    assert not np.array_equal(lo.curves.allocated, direct.curves.allocated)  # the world size does change the rank's bytes


@pytest.mark.parametrize("world", [4, 16])
@pytest.mark.parametrize("name", NAMES)
def test_a_rank_at_the_larger_batch_is_derived_from_another_world(tiny_model, name, world):
    """At 16 ranks the vocabulary's 1,000 rows are padded: the batch derivation holds all the same."""
    workload = load_workload(str(tiny_model("llama")), seq_len=32)
    recipe = RECIPES[name].resolved(workload)
    lo, lo_next, other, direct = (_traced(workload, recipe, "forward-backward", n, batch)
                                  for n, batch in ((2, 2), (2, 3), (world, 2), (world, 3)))
    derived = derive_batch(lo, lo_next, other)
    assert derived is not None and derived.rank is not None and derived.rank.world == world
    _assert_same_rank(derived, direct)
    assert not np.array_equal(other.curves.allocated, direct.curves.allocated)  # the batch size does change them
    assert derive_batch(lo, other, direct) is None  # the batch sizes at one world size, the world sizes at the other


def test_padded_shards_are_traced_not_derived(tiny_model):
    workload = load_workload(str(tiny_model("llama")), seq_len=32)
    recipe = RECIPES["fp32 full_shard"].resolved(workload)
    lo, hi = (_traced(workload, recipe, "optimizer", n) for n in (2, 4))
    assert derive(lo, hi, 16) is None  # 1,000 rows over 16 ranks: padded to 1,008
    with parts.worlds_derived_from(2, 4):
        assert parts._basis_requests(workload, parts.PartRequest(recipe, "optimizer", 2, 1, 16)) == []
        assert len(parts._basis_requests(workload, parts.PartRequest(recipe, "optimizer", 2, 1, 8))) == 2
    assert parts._basis_requests(workload, parts.PartRequest(recipe, "optimizer", 2, 1, 8)) == []  # outside the block: traced


def _trace(category, sizes):
    """A trace of three allocations of `sizes` bytes, the second of `category`, the first freed before the third."""
    allocations = {i: Allocation(i, n, Phase.FORWARD, category if i == 1 else MemoryCategory.TEMPORARY)
                   for i, n in enumerate(sizes)}
    events = [Event(0, sizes[0], Phase.FORWARD), Event(1, sizes[1], Phase.FORWARD), Event(0, -sizes[0], Phase.FORWARD),
              Event(2, sizes[2], Phase.FORWARD)]
    return Trace(allocations=allocations, events=events)


def _step(trace, world):
    return StepTrace(phases=[Phase.FORWARD], curves=curves_of(trace), ops=(), parameters=1, trainable_parameters=1,
                     op_count=3, rank=RankEvents(world=world, rows_divisor=64, trace=trace))


def test_sizes_affine_in_one_over_the_world_size():
    weights = MemoryCategory.WEIGHTS
    derived = derive(_step(_trace(weights, [4096, 1024, 512]), 2), _step(_trace(weights, [2048, 1024, 512]), 4), 8)
    assert derived is not None and derived.rank is not None
    assert [e.nbytes for e in derived.rank.trace.events] == [1024, 1024, -1024, 512]
    # made as another category at one world size: not the same step
    assert derive(_step(_trace(weights, [4096, 1024, 512]), 2),
                  _step(_trace(MemoryCategory.GRADIENTS, [2048, 1024, 512]), 4), 8) is None
    # not a whole number of bytes at 8
    assert derive(_step(_trace(weights, [4097, 1024, 512]), 2), _step(_trace(weights, [2048, 1024, 512]), 4), 8) is None


@pytest.mark.slow  # over 15 s on 2 cores
def test_an_estimate_is_the_same_derived_or_traced(tiny_model, cache_folder):
    """Within `worlds_derived_from(2, 4)` estimates on 2, 4 and 8 GPUs read derived traces (the cache then holds
    none traced at 8, and at 4 only the passes at the smaller batch size), and say what they say with every
    world traced."""
    from anatomist.estimate.memory import estimate_memory
    from anatomist.hardware import get_gpu
    from anatomist.trace.store import cache

    workload = load_workload(str(tiny_model("llama")), seq_len=32)
    gpu = get_gpu("A100-80GB")
    recipe = RECIPES["fp32 full_shard"].resolved(workload)
    worlds = (2, 4, 8)
    with parts.worlds_derived_from(2, 4):
        derived = [estimate_memory(workload, recipe, gpu, num_gpus=n).to_dict() for n in worlds]
    assert all(t.rank is not None and not t.ops for t in _cached_at(cache, 8)), "a trace at 8 was traced, not derived"
    passes_at_4 = [t for t in _cached_at(cache, 4) if t.static_bytes == {}]  # of each cut, at each batch size
    assert sorted(bool(t.ops) for t in passes_at_4) == [False] * (len(passes_at_4) // 2) + [True] * (len(passes_at_4) // 2)
    cache.clear_memory()
    for stored in cache_folder.iterdir():
        stored.unlink()
    traced = [estimate_memory(workload, recipe, gpu, num_gpus=n).to_dict() for n in worlds]
    assert all(t.ops for t in _cached_at(cache, 8))
    assert derived == traced


def _cached_at(cache, world):
    """The FSDP traces in the memory cache taken at `world` ranks."""
    found = [t for t in cache._memory._table.values() if getattr(t, "rank", None) is not None and t.rank.world == world]
    assert found
    return found
