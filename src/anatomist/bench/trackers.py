"""PyTorch's memory trackers as `bench --suite distributed` and the FSDP accuracy tests (tests/fsdp_truth.py)
measure a rank with: FSDPMemTracker measuring the step FSDP runs without it (`GroupedFSDPMemTracker`), and, off
CUDA, the step run and counted as on CUDA (`as_on_cuda`).

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
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks


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
def as_on_cuda(half: bool) -> Iterator[None]:
    """Off CUDA, within it steps run and are counted as on CUDA: CUDA's code paths (which dropout and SDPA kernels
    run, and what they save), CUDA's autocast policy where the step autocasts to a half dtype (`half`), and PyTorch's
    trackers counting storages in 512-byte blocks (`cuda_block_sizes`). On CUDA nothing changes."""
    if torch.cuda.is_available():
        yield
        return
    from anatomist.trace.autocast import cuda_autocast_policy
    from anatomist.trace.cuda_model import cuda_code_paths

    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_code_paths())
        if half:
            stack.enter_context(cuda_autocast_policy())
        stack.enter_context(cuda_block_sizes())
        yield
