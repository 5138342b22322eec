"""PyTorch's own accounting of one real training step: the independent side of the accuracy tests.

`measure_step` runs one steady-state step (a first step creates the optimizer state) under
`torch.distributed._tools.mem_tracker.MemTracker`, as the Trainer runs it: forward (under
bf16 autocast with CUDA's policy when the recipe asks for it), backward, clipping, the
optimizer step, zero_grad(set_to_none=True), with CUDA's code paths (`cuda_code_paths`).
`count_as_on_cuda` makes MemTracker round each storage to the CUDA allocator's 512 bytes,
which it does on CUDA devices only.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch.distributed._tools import mem_tracker
from torch.distributed._tools.mem_tracker import MemTracker

from anatomist.recipe import Recipe
from anatomist.trace.engine.autocast import cuda_autocast_policy
from anatomist.trace.engine.cuda_paths import cuda_code_paths
from anatomist.trace.step.inputs import make_batch
from anatomist.trace.step.optimizer_build import build_optimizer


def round_to_block(nbytes: int) -> int:
    """`nbytes` as the CUDA caching allocator rounds a request (512-byte blocks)."""
    return math.ceil(nbytes / mem_tracker._PYTORCH_MIN_ALLOCATE) * mem_tracker._PYTORCH_MIN_ALLOCATE


def count_as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mem_tracker._WeakRefInfo, "_calculate_mem_consumed",
                        lambda self: round_to_block(self.size * self.element_size))


def measure_step(workload, recipe: Recipe, model: torch.nn.Module, batch: int) -> tuple[dict[str, int], dict[str, int]]:
    """MemTracker's snapshots of one steady-state step of `model`, at its peak and after it:
    bytes by MemTracker's categories (PARAM, BUFFER, GRAD, ACT, TEMP, OPT) and Total."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(recipe, params)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if recipe.bf16 else contextlib.nullcontext()
    policy = cuda_autocast_policy() if recipe.bf16 else contextlib.nullcontext()

    def step() -> None:
        with autocast:
            loss = model(**make_batch(workload, batch)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, recipe.max_grad_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with cuda_code_paths(), policy:
        return steady_step_snapshots(step, model, optimizer)


def steady_step_snapshots(step, *tracked) -> tuple[dict[str, int], dict[str, int]]:
    """MemTracker's snapshots of the second call of `step` (the first creates the optimizer state), at its peak
    and after it, by category name; `tracked`: the modules and optimizers MemTracker attributes storages to."""
    step()
    tracker = MemTracker()
    tracker.track_external(*tracked)
    with tracker:
        step()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    (after,) = tracker.get_tracker_snapshot("current").values()

    def by_name(stats: dict) -> dict[str, int]:
        return {str(k).removeprefix("_MemRefType."): v for k, v in stats.items()}

    return by_name(peak), by_name(after)
