"""TRL's activation offloading on the traced step (`Recipe.activation_offloading`).

TRL's SFTTrainer and DPOTrainer with `activation_offloading=True` (and axolotl's `activation_offloading: true`,
through its own trainers) run each training step under `get_act_offloading_ctx_manager(model)`
(trl/models/activation_offloading.py): saved-tensor hooks that copy what autograd saves to pinned host memory in
forward and back in backward. It needs CUDA (streams, pinned memory), so the trace runs a stand-in of its
`OffloadActivations` with TRL's defaults (pinned memory, a side stream, `min_offload_size` 1,024 bytes,
`max_fwd_stash_size` 5), read from trl 1.16.0:

- pack (forward): a tensor stays on the device if its storage (start and dtype) was packed within the last
  five packs, if it holds fewer than 1,024 bytes, if it is a parameter or a buffer or shares a parameter's
  storage, or if it is saved inside the output head (hooks on the model's `output` or `lm_head` turn the
  offloading off there: TRL's fused LM head reads `lm_head.weight` without calling the module, so under TRL's
  trainers the head's saved tensors leave too). The 1,024 bytes of a tensor whose rows are the batch's samples or
  tokens are judged at 2 samples in a trace of more (`JUDGED_AT_BATCH`). Any other is copied to the host (a view
  with an offset or a non-contiguous one cloned on the device first), and its device copy is kept until five more
  tensors are packed (the stash that lets the side stream finish).
- unpack (backward): a tensor still in the stash is used as is; any other is copied back to the device and kept
  until the autograd node after the one that used it has run (or longer, where the node kept a reference);
  the first backward node to run frees what is left of the forward stash.

The host copies are made with the tracer paused (no device memory); the copies back are device allocations
whose cost is not an op of the device (a host-to-device transfer on the side stream).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

MIN_OFFLOAD_BYTES = 1024
"""OffloadActivations' min_offload_size default: smaller tensors stay on the device."""
STASH = 5
"""OffloadActivations' max_fwd_stash_size default: packed tensors kept on the device until their copy is done."""
JUDGED_AT_BATCH = 2
"""The batch (the smaller of estimate.traces.TRACE_BATCHES) at which the size of a tensor that grows with the batch
meets MIN_OFFLOAD_BYTES. Judged at its own, a [batch, 511] mask of TRL's loss stays at batch 2 and leaves at 3: the
two traces the estimator extrapolates from would differ in their ops (gpt2 at its 512 positions under --trainer sft
did). Judged at 2, both make the same choices; at a larger batch such a tensor, a few KiB, stays where TRL moves it."""


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module TRL's get_act_offloading_ctx_manager keeps out of the offloading: `output` (or its `linear`), else
    `lm_head`, of the model (a PEFT model's base model)."""
    unwrapped: Any = getattr(model, "module", model)
    if hasattr(unwrapped, "base_model") and hasattr(unwrapped, "peft_config"):
        unwrapped = unwrapped.base_model
    output = getattr(unwrapped, "output", None)
    if output is not None:
        if isinstance(output, torch.nn.Module):
            return output
        linear = getattr(output, "linear", None)
        return linear if isinstance(linear, torch.nn.Module) else None
    head = getattr(unwrapped, "lm_head", None)
    return head if isinstance(head, torch.nn.Module) else None


class OffloadedActivations(torch.autograd.graph.saved_tensors_hooks):
    """TRL's OffloadActivations as it runs on a GPU with its defaults, for `tracer` (module docstring). One step:
    enter it around one micro-batch's forward and backward, as TRL's training_step does."""

    def __init__(self, tracer: Any, model: torch.nn.Module, batch_size: int) -> None:
        self.tracer = tracer
        self.batch_size = batch_size
        self.parameter_storages = {p.untyped_storage()._cdata for p in model.parameters()}
        self.tracked: dict[int, tuple[torch.Tensor, tuple[Any, ...] | None]] = {}
        """Packed id -> the tensor kept on the device (layout None), or the host copy and the layout to restore."""
        self.stash: dict[int, torch.Tensor] = {}
        """Forward: packed id -> its device tensor, kept while the side stream copies it."""
        self.key_of: dict[int, tuple[Any, ...]] = {}
        self.id_of: dict[tuple[Any, ...], int] = {}
        """A storage packed lately (TRL's storage_to_tensor_id): packed again, it stays on the device."""
        self.brought_back: dict[int, torch.Tensor] = {}
        """Backward: unpacked id -> its device copy, until a later node has run."""
        self.count = 0
        self.node: Any = None
        super().__init__(self._pack, self._unpack)

    def _pack(self, activation: torch.Tensor) -> int:
        self.count += 1
        tensor_id, key = self.count, self._storage_key(activation)
        if key in self.id_of:
            self.tracked[tensor_id] = (activation, None)
            self._track(key, tensor_id)
            return tensor_id
        if self._below_min_offload_size(activation) \
                or isinstance(activation, torch.nn.Parameter) \
                or activation.untyped_storage()._cdata in self.parameter_storages:
            self.tracked[tensor_id] = (activation, None)
            return tensor_id
        broadcast = 0 in activation.stride()
        if not broadcast and (not activation.is_contiguous() or activation.storage_offset() != 0):
            activation = activation.clone(memory_format=torch.contiguous_format)
        for old in [i for i in self.stash if i <= tensor_id - STASH]:
            del self.stash[old]
            self._release(old)
        with self.tracer.paused():  # the copy in pinned host memory
            if broadcast:
                host = torch.empty(activation.untyped_storage().nbytes() // activation.element_size(),
                                   dtype=activation.dtype)
                host.copy_(torch.as_strided(activation, (host.numel(),), (1,), 0))
            else:
                host = torch.empty_like(activation)
                host.copy_(activation)
        self.tracked[tensor_id] = (host, (activation.size(), activation.stride(), activation.storage_offset()))
        if self.tracer.micro_step == 0:
            self.tracer.trace.offloaded_bytes += host.untyped_storage().nbytes()
        self.stash[tensor_id] = activation
        self._track(key, tensor_id)
        return tensor_id

    def _below_min_offload_size(self, tensor: torch.Tensor) -> bool:
        nbytes = tensor.element_size() * tensor.nelement()
        if self.batch_size > JUDGED_AT_BATCH and tensor.dim() and tensor.shape[0] % self.batch_size == 0:
            nbytes = nbytes * JUDGED_AT_BATCH // self.batch_size  # rows of samples or tokens: as at JUDGED_AT_BATCH
        return nbytes < MIN_OFFLOAD_BYTES

    def _storage_key(self, tensor: torch.Tensor) -> tuple[Any, ...]:
        """TRL's `_get_unique_tensor_key` (data pointer + storage offset, dtype), with the tracer's allocation for the
        pointer: a storage freed and another made at its address are two (TRL could take the second for the first
        where its pack cloned the first and the allocator reused the block; that is not reproduced)."""
        allocation = self.tracer.allocation_of(tensor)
        return (allocation if allocation is not None else tensor.untyped_storage()._cdata,
                tensor.storage_offset(), tensor.dtype)

    def _track(self, key: tuple[Any, ...], tensor_id: int) -> None:
        self.id_of[key] = tensor_id
        self.key_of[tensor_id] = key

    def _release(self, tensor_id: int) -> None:
        key = self.key_of.pop(tensor_id, None)
        if key is not None and self.id_of.get(key) == tensor_id:
            del self.id_of[key]

    def _unpack(self, tensor_id: int) -> torch.Tensor:
        tensor, layout = self.tracked.pop(tensor_id)
        self._release(tensor_id)
        if layout is None:
            return tensor
        node = torch._C._current_autograd_node()
        previous = list(self.brought_back) if node is not self.node else []
        self.node = node
        from_stash = tensor_id in self.stash
        if from_stash:
            device = self.stash[tensor_id]
        else:
            with self.tracer.kernels(()):  # a host-to-device copy on the side stream: no kernel of the step
                device = torch.empty_like(tensor)
                device.copy_(tensor)
            device = torch.as_strided(device, *layout)
            self.brought_back[tensor_id] = device
        references = torch._C._storage_Use_Count(device.untyped_storage()._cdata)

        def after_node(outputs: Any, _inputs: Any) -> Any:
            kept = self.brought_back.get(tensor_id)
            if kept is not None and torch._C._storage_Use_Count(kept.untyped_storage()._cdata) > references:
                del self.brought_back[tensor_id]  # the node holds it on: its reference frees it
            for i in list(self.stash):
                del self.stash[i]
                self._release(i)
            for i in previous:
                self.brought_back.pop(i, None)
            return outputs

        node.register_hook(after_node)
        return device

    def clear(self) -> None:
        """TRL's callback at the end of backward: what the stashes hold is freed."""
        self.stash.clear()
        self.brought_back.clear()
        self.tracked.clear()


@contextlib.contextmanager
def offloaded_activations(model: torch.nn.Module, tracer: Any, batch_size: int) -> Iterator[None]:
    """Within: one micro-batch's forward and backward (of `batch_size` samples) offload their saved activations as
    TRL's does."""
    hooks = OffloadedActivations(tracer, model, batch_size)
    kept_on_device = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)  # TRL's NoOpManager
    head = output_head(model)
    handles = []
    if head is not None:
        handles = [head.register_forward_pre_hook(lambda *_: kept_on_device.__enter__()),
                   head.register_forward_hook(lambda *_: kept_on_device.__exit__(None, None, None), always_call=True)]
    try:
        with hooks:
            yield
    finally:
        hooks.clear()
        for handle in handles:
            handle.remove()
