"""PyTorch's memory trackers as `bench --suite distributed` and the FSDP accuracy tests (tests/fsdp_truth.py)
measure a rank with: FSDPMemTracker measuring the step FSDP runs without it (`GroupedFSDPMemTracker`), off
CUDA the step run and counted as on CUDA (`as_on_cuda`), and over gloo each collective holding what NCCL's would
(`collectives_hold_nothing`).

accelerate shards the final norm and the output head as one unit (`fully_shard([norm, lm_head])`), whose
forward hooks FSDP registers as a group: its pre-forward work once, its post-forward (reshard, the
pre-backward hook) after the last module. FSDPMemTracker (torch 2.13) re-registers them on each module
alone, which changes the backward (seen on the decoders of test_fsdp_accuracy.py, fp32): the head's
gradient is reduce-scattered alone, the unit all-gathered again for the norm, and the norm's 1,024 bytes
reduce-scattered after it, where FSDP reduce-scatters the two together once (1,025,024 bytes), its input
kept until the next unit's post-backward. `GroupedFSDPMemTracker` registers the tracker's wrappers as
FSDP's group instead. It uses FSDP's private `_register_group_forward_hooks` and the tracker's private
wrappers: a torch that renames them fails here, loudly, not with a changed step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


class GroupedFSDPMemTracker(FSDPMemTracker):
    """FSDPMemTracker whose hooks on a unit of several modules are FSDP's group (module docstring)."""

    def _instrument_fsdp_module(self) -> None:
        super()._instrument_fsdp_module()
        states = {id(s): s for m in self._root_mod.modules() if isinstance(m, FSDPModule)
                  for s in [m._get_fsdp_state()] if len(s._modules) > 1}
        for state in states.values():
            self._regroup(state)

    def _regroup(self, state: Any) -> None:
        ours = (state._pre_forward, state._post_forward)
        for module in state._modules:  # the tracker's wrappers of FSDP's hooks, one pair on each module
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                for key in [k for k, h in hooks.items() if getattr(h, "__wrapped__", None) in ours]:
                    del hooks[key]
                    module._forward_pre_hooks_with_kwargs.pop(key, None)
                    module._forward_hooks_always_called.pop(key, None)
        pre = {m: self._fsdp_state_pre_forward(m, state._pre_forward) for m in state._modules}
        post = {m: self._fsdp_state_post_forward(m, state._post_forward) for m in state._modules}
        handle = _register_group_forward_hooks(
            state._modules, lambda module, *args: pre[module](module, *args),
            lambda module, *args: post[module](module, *args), state._modules_to_run_forward,
            state._cast_output_dtype)
        state._pre_forward_hook_handle = state._post_forward_hook_handle = handle  # removed on exit


@contextlib.contextmanager
def cuda_block_sizes() -> Iterator[None]:
    """Within it, PyTorch's mem_tracker counts a CPU storage as the CUDA allocator would: in 512-byte
    blocks (its own rule for CUDA storages, `_WeakRefInfo._calculate_mem_consumed`)."""
    from torch.distributed._tools import mem_tracker

    info: Any = mem_tracker._WeakRefInfo
    block = mem_tracker._PYTORCH_MIN_ALLOCATE
    original = info._calculate_mem_consumed
    info._calculate_mem_consumed = lambda self: math.ceil(self.size * self.element_size / block) * block
    try:
        yield
    finally:
        info._calculate_mem_consumed = original


@contextlib.contextmanager
def cuda_optimizer_defaults() -> Iterator[None]:
    """Within it, a torch optimizer left to choose its implementation (`foreach=None`, as the Trainer builds AdamW and
    SGD) chooses as on CUDA: the foreach kernels, one temporary per step for all parameters, where the CPU's for-loop
    makes two of the largest parameter at once (`torch.optim.optimizer._default_to_fused_or_foreach` reads the
    devices that have foreach kernels from `_get_foreach_kernels_supported_devices`, which names no CPU)."""
    from torch.optim import optimizer

    original = optimizer._get_foreach_kernels_supported_devices
    optimizer._get_foreach_kernels_supported_devices = lambda: [*original(), "cpu"]
    try:
        yield
    finally:
        optimizer._get_foreach_kernels_supported_devices = original


@contextlib.contextmanager
def as_on_cuda(half: bool) -> Iterator[None]:
    """Off CUDA, within it steps run and are counted as on CUDA: CUDA's code paths (which dropout and SDPA kernels
    run, and what they save; which kernels an optimizer left to choose runs), CUDA's autocast policy where the step autocasts to a half dtype (`half`), and PyTorch's
    trackers counting storages in 512-byte blocks (`cuda_block_sizes`). On CUDA nothing changes."""
    if torch.cuda.is_available():
        yield
        return
    from anatomist.trace.engine.autocast import cuda_autocast_policy
    from anatomist.trace.engine.cuda_paths import cuda_code_paths

    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_code_paths())
        stack.enter_context(cuda_optimizer_defaults())
        if half:
            stack.enter_context(cuda_autocast_policy())
        stack.enter_context(cuda_block_sizes())
        yield


class _CollectiveOnly(TorchDispatchMode):
    """Within a collective's call: the collective's own op goes on to the trackers below (FSDPMemTracker names the
    all-gather output and the reduce-scatter input by it), every other op runs out of their sight."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in ("c10d", "_c10d_functional"):
            return func(*args, **(kwargs or {}))
        with _disable_current_modes():
            return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def collectives_hold_nothing() -> Iterator[None]:
    """Within it, each gloo collective FSDP calls runs as NCCL's would for PyTorch's trackers: it holds nothing
    after it returns, and what gloo makes of its own within it is out of their sight.

    Gloo's worker thread keeps references to a collective's tensors until it drops the finished work, which can be
    after the call has returned (seen: a storage's use count still raised after `all_gather_single` returned, in
    about half the calls): the call returns once the use counts of FSDP's tensors have fallen back. Its
    reduce-scatter also works on a copy of its input of its own (FSDPMemTracker saw it made at gloo's `aten.split`),
    which NCCL does not make: within the call the trackers see the collective's own op (which names FSDP's buffers)
    and nothing else gloo runs (`_CollectiveOnly`). Before, the copy was counted while the call ran and
    waited for after it: on a model whose output head is its own FSDP unit and holds a 32,000-token vocabulary, the
    end of backward, where the embeddings' gradient is reduce-scattered, read 6.5% above the same step over the fake
    process group (whose collectives make nothing).
    """
    import torch.distributed as dist

    def held(tensors: list[torch.Tensor]) -> list[int]:
        return [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors]

    def wait_until(done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"gloo kept {what} for a minute")
            time.sleep(0)

    def released(collective: Callable[..., Any]) -> Callable[..., None]:
        def call(*args: Any, **kwargs: Any) -> None:
            if kwargs.get("async_op"):  # only with fully_shard(...).unshard_async_op, which accelerate leaves off
                raise RuntimeError("collectives_hold_nothing expects FSDP's collectives to be synchronous")
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            before = held(tensors)
            with _CollectiveOnly():  # gloo's own copies, out of the trackers' sight: NCCL makes none
                collective(*args, **kwargs)
            wait_until(lambda: held(tensors) == before, "a collective's tensors")
        return call

    all_gather, reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single
    dist.all_gather_single = released(all_gather)  # FSDP calls them as dist.*
    dist.reduce_scatter_single = released(reduce_scatter)
    try:
        yield
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = all_gather, reduce_scatter
