"""FSDP2 on the traced model: the real `fully_shard` step, per rank, under PyTorch's fake process group.

A sharded recipe (`Recipe.fsdp`) is traced as PyTorch runs it, not computed: the model cut to a few
blocks is wrapped by `torch.distributed.fsdp.fully_shard` the way the Trainer wraps it (transformers
5 drives FSDP through accelerate with `fsdp_version: 2` by default; `wrap` below follows accelerate
1.15's `fsdp2_prepare_model`) on a CPU device mesh of the target world size over PyTorch's fake
process group (`init_process_group("fake")`: collectives return at once, with no data), with fake
tensors as every trace. What this rank allocates is then what FSDP allocates: its shard of the
parameters, gradients and optimizer state, the unsharded parameters of the units in flight
(the backward prefetch included), the all-gather and reduce-scatter buffers.

`ShardedStepTracer` adds to the tracer what FSDP2 does outside the dispatcher or through subclasses:
- DTensor parameters and gradients: their ops are left to DTensor (NotImplemented), which runs them
  on the local shards, which the tracer then sees; a DTensor is counted by its local shard.
- `UntypedStorage.resize_`: FSDP2 frees and re-allocates the unsharded parameters by resizing their
  storages (`_fsdp_param.free_storage` / `alloc_storage`), which no dispatch mode sees; the tracer
  patches it for the step. A storage FSDP resizes is an unsharded parameter: a weight.
- collectives: the all-gather output (`c10d._allgather_base_`) and the reduce-scatter input
  (`c10d._reduce_scatter_base_`) are FSDP's communication buffers: functionality-specific memory.
- the unsharded gradients autograd accumulates before FSDP reduce-scatters them are gradients, as
  the sharded ones are.
- CPU offload (`CPUOffloadPolicy`): the sharded parameters, gradients, optimizer state and the
  optimizer step live on the host: left out of the device's count.

Streams, as FSDP2 allocates on them (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): the
all-gather output of forward and pre-backward on its all-gather copy-in stream (`get_all_gather_streams`),
the reduce-scatter's output on its reduce-scatter stream, the reduce-scatter's input on the compute stream.
Each allocation carries its stream, and the allocator model keeps each stream's cached blocks apart: this is
what the reserved memory of a sharded step holds beyond a single pool's.

What a trace on the CPU mesh does not show of the streams: their timing. FSDP2 all-gathers the next unit on
its own stream while the current one computes (implicit forward prefetch); on the CPU the units run
one after another, so in forward one unit's parameters are unsharded at a time (PyTorch's
FSDPMemTracker on a CPU step counts the same); in backward FSDP2 prefetches explicitly, and both
are traced. The host-to-device copy of an offloaded shard before its all-gather is not traced
(on a CPU mesh it is no copy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from anatomist.anatomy import MemoryCategory, Phase
from anatomist.axes.shardings import RESHARD_AFTER_FORWARD
from anatomist.errors import InputError
from anatomist.recipe import ResolvedRecipe
from anatomist.recipe.axis_values import autocast_dtype
from anatomist.trace.engine.records import ALL_GATHER_STREAM, COMPUTE_STREAM, REDUCE_SCATTER_STREAM, Allocation, Event
from anatomist.trace.engine.tracer import DEVICE_QUERY, StepTracer

_c10d = torch.ops.c10d
_functional = torch.ops._c10d_functional

@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[DeviceMesh]:
    """A CPU device mesh of `world_size` ranks over PyTorch's fake process group; this process is rank 0.

    The group is this context's own: made on entry, destroyed on exit.

    Raises:
        RuntimeError: this process already belongs to a process group (a real one, or a trace's
            still open): a fake world cannot be made beside it.
    """
    with fake_process_group(world_size):
        yield init_device_mesh("cpu", (world_size,))  # made outside any fake mode: it reads its ranks


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """PyTorch's fake process group of `world_size` ranks, this process rank 0, for this context only (`fake_world`).

    Raises:
        RuntimeError: this process already has a process group.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a sharded step cannot be traced in a process that already has a process group; "
                           "trace it in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def mixed_precision_policy(recipe: ResolvedRecipe) -> MixedPrecisionPolicy:
    """What accelerate gives FSDP2 for the recipe's mixed precision (accelerate 1.15
    `FullyShardedDataParallelPlugin.set_mixed_precision`: parameters all-gathered, gradients reduced
    and outputs returned in the half dtype); without mixed precision, none."""
    name = autocast_dtype(recipe)
    if name is None:
        return MixedPrecisionPolicy()
    dtype = getattr(torch, name)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)


def block_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """The module classes FSDP wraps one unit each: the classes of the model's repeated blocks
    (`layout.block_lists`), which `plan --emit` writes as `transformer_layer_cls_to_wrap`.

    Not the model's `_no_split_modules`, accelerate's default: for most decoders it names the same
    class, but where it also names a module holding the input embeddings (BertEmbeddings,
    ModernBertEmbeddings) accelerate 1.15 wraps that module, then wraps the embeddings inside it again
    and fails ("Invariant encountered", checked on BertForSequenceClassification here); naming the
    blocks is what makes such a model run, and what the emitted configuration says.

    Raises:
        InputError: the model has no repeated block that FSDP could shard unit by unit.
    """
    from anatomist.trace.depth.layout import block_lists

    config = getattr(model, "config", None)
    classes = {type(b) for _, blocks in (block_lists(model, config) if config is not None else []) for b in blocks}
    if not classes:
        raise InputError(f"{type(model).__name__}: FSDP shards a model block by block, and this model has no repeated "
                         "block to wrap (its layers are shared or unlisted); use DeepSpeed ZeRO (--zero-stage) instead")
    return tuple(sorted(classes, key=lambda c: c.__name__))


def _final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The base model's last direct child whose class is a norm (accelerate's `_find_final_norm`)."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    if not isinstance(base, torch.nn.Module):
        return None
    found = None
    for _, child in base.named_children():
        if "Norm" in type(child).__name__:
            found = child
    return found


def wrap(model: torch.nn.Module, recipe: ResolvedRecipe, mesh: DeviceMesh) -> None:
    """Apply FSDP2 to `model` in place, as accelerate 1.15's `fsdp2_prepare_model` does for the Trainer.

    1. With mixed precision (and no 4-bit base), trainable parameters not in fp32 become fp32: FSDP2
       keeps fp32 sharded masters and gathers them in the half dtype (`MixedPrecisionPolicy`).
    2. Each block (`block_classes`: the repeated blocks, as `transformer_layer_cls_to_wrap` names them) is
       its own unit, bottom-up.
    3. The input embeddings (when not tied to the output head) are a unit; the final norm and the
       output head (with the embeddings when tied) are one more, never resharded after forward.
    4. The root takes the rest, with FSDP's default for the root (not resharded after forward).
    Every unit: `reshard_after_forward` from the strategy, the recipe's mixed precision, and
    `CPUOffloadPolicy` with `offload="cpu"`.
    """
    classes = block_classes(model)
    # Pinned or not, host memory is not the device's; fake tensors cannot be pinned.
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=False) if recipe.offload == "cpu" else OffloadPolicy()
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": RESHARD_AFTER_FORWARD[recipe.fsdp],
                              "mp_policy": mixed_precision_policy(recipe), "offload_policy": offload}
    if recipe.mixed_precision != "no" and not recipe.load_in_4bit:
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)
    for module in reversed(_top_down(model)[1:]):
        if isinstance(module, classes) and not isinstance(module, FSDPModule):
            fully_shard(module, **kwargs)
    hf: Any = model  # a transformers (or peft) model: its methods are not nn.Module's
    embed = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    tied = embed is not None and head is not None and getattr(embed, "weight", None) is getattr(head, "weight", 0)
    if embed is not None and not tied and not isinstance(embed, FSDPModule):
        fully_shard(embed, **kwargs)
    tail = [m for m in ((_final_norm(model), embed, head) if tied else (_final_norm(model), head))
            if m is not None and not isinstance(m, FSDPModule)]
    if tail:
        fully_shard(tail, **{**kwargs, "reshard_after_forward": False})
    fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})


def rows_divisor(model: torch.nn.Module) -> int:
    """`layout.rows_divisor` of the parameters FSDP has sharded in `model`: at a world size that divides it, every size
    FSDP allocates is a whole part of the unsharded one."""
    from anatomist.trace.depth.layout import rows_divisor as of

    return of(p for p in model.parameters() if isinstance(p, DTensor))


def _top_down(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules in the order accelerate's `get_module_children_bottom_up` reverses: a stack walk."""
    stack, ordered = [model], []
    while stack:
        module = stack.pop()
        stack.extend(child for _, child in module.named_children())
        ordered.append(module)
    return ordered


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Within it, FSDP reduce-scatters this micro-batch's gradients only if `sync`: the Trainer runs all
    micro-batches but the last under `accelerator.no_sync`, which for FSDP2 is
    `set_requires_gradient_sync(False)`: the unsharded gradients accumulate on every rank until the last.
    A model without FSDP: nothing."""
    if not isinstance(model, FSDPModule) or sync:
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def accumulated_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients FSDP2 keeps unsharded between micro-batches (`gradient_sync`) in its reduce dtype where that is
    not the parameters' (`FSDPParam.unsharded_accumulated_grad`: fp32 beside bf16 weights), this rank's part of each."""
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    return [_local(p.unsharded_accumulated_grad) for group in groups if group is not None for p in group.fsdp_params
            if p.unsharded_accumulated_grad is not None]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds); any other tensor itself."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


class ShardedStepTracer(StepTracer):
    """The tracer of one rank of an FSDP2 step (see the module docstring)."""

    def __init__(self, lower_precision_dtype: torch.dtype | None = None, *, record_ops: bool = False,
                 offload: bool = False) -> None:
        super().__init__(lower_precision_dtype, record_ops=record_ops)
        self.offload = offload
        self._entry_mode: Any = None
        self._original_resize: Any = None
        self._propagating = False
        """Inside DTensor's shape propagation, which runs an op once per op and shape on fake tensors of the
        active fake mode (`ShardingPropagator._propagate_tensor_meta_non_cached`, cached after): not the step's."""
        self._original_propagate: Any = None
        self._hooked: set[int] = set()
        """ids of the unsharded parameters hooked (they live as long as the model)."""
        self.state_storages: tuple[int, ...] = ()
        """Bytes of each storage of the optimizer state on the device (`state_bytes`)."""

    def register(self, tensor: torch.Tensor, category: MemoryCategory) -> None:
        super().register(_local(tensor), category)
        if self.offload and isinstance(tensor, DTensor):  # a sharded parameter of CPUOffloadPolicy: on the host
            self._to_host(_local(tensor))

    def label_live(self, tensors: list[torch.Tensor], category: MemoryCategory) -> None:
        local = [_local(t) for t in tensors]
        super().label_live(local, category)
        if self.offload and category in (MemoryCategory.GRADIENTS, MemoryCategory.OPTIMIZER_STATES):
            for t, original in zip(local, tensors, strict=True):
                if isinstance(original, DTensor):  # sharded gradients and states: on the host
                    self._to_host(t)

    def _to_host(self, tensor: torch.Tensor) -> None:
        st = tensor.untyped_storage()
        entry = self._live.get(st._cdata)
        if entry is not None:
            self.trace.allocations[entry[0]].host = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs the op on the local shards, which come back here
        if func is DEVICE_QUERY or self._propagating or active_fake_mode() is not self._entry_mode:
            return func(*args, **(kwargs or {}))  # a device query, DTensor's shape propagation: no memory of the step
        if func is _functional.wait_tensor.default:
            return args[0]  # the fake kernel makes a new tensor where the real one waits on its input
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is _c10d._allgather_base_.default:
            self._label(args[0], MemoryCategory.FUNCTIONALITY, ALL_GATHER_STREAM)
        elif func is _c10d._reduce_scatter_base_.default:
            self._label(args[1], MemoryCategory.FUNCTIONALITY, COMPUTE_STREAM)  # allocated before it switches streams
            self._label(args[0], None, REDUCE_SCATTER_STREAM)  # the reduced shards
        if self.offload and self.phase is Phase.OPTIMIZER:  # CPUOffloadPolicy: the step runs on the host
            for t in _tensors(out):
                self._to_host(t)
        return out

    def _label(self, tensor: torch.Tensor, category: MemoryCategory | None, stream: int) -> None:
        """`tensor`'s storage is a collective's buffer, allocated on FSDP2's `stream`; of `category` unless settled."""
        entry = self._live.get(tensor.untyped_storage()._cdata)
        if entry is None:
            return
        allocation = self.trace.allocations[entry[0]]
        allocation.stream = stream
        if category is not None and not allocation.fixed:
            self.set_category(entry[0], category)

    # -- storages FSDP resizes: the unsharded parameters -----------------------------------
    def _resize(self, storage: torch.UntypedStorage, size: int) -> None:
        self._original_resize(storage, size)
        key = storage._cdata
        entry = self._live.get(key)
        if entry is None:
            return
        alloc_id, ref = entry
        old = self.trace.allocations[alloc_id]
        if old.nbytes > 0:
            self.trace.events.append(self._event(alloc_id, -old.nbytes))
        fresh = self._new_allocation(int(storage.nbytes()), old)
        self._live[key] = (fresh, ref)

    def _new_allocation(self, nbytes: int, like: Allocation) -> int:
        alloc_id = next(self._ids)
        like.category, like.fixed = MemoryCategory.WEIGHTS, True  # a storage FSDP resizes is a parameter
        self.trace.allocations[alloc_id] = Allocation(alloc_id, nbytes, self.phase, MemoryCategory.WEIGHTS, True,
                                                      like.op, like.host)
        if nbytes > 0:
            self.trace.events.append(self._event(alloc_id, nbytes))
        return alloc_id

    def _event(self, alloc_id: int, nbytes: int) -> Event:
        return Event(alloc_id, nbytes, self.phase, self.segment, self.micro_step, self.block)

    def begin_micro_batch(self, micro: int) -> None:
        """No trace of one micro-batch is kept apart: under FSDP the first of two does not reduce its
        gradients (`gradient_sync`), where a step of one micro-batch does."""
        self.micro_step = micro

    def state_bytes(self, tensors: list[torch.Tensor]) -> int:
        """Device bytes of this rank's shards of `tensors` (none on the device under CPU offload); each storage's
        bytes, before the allocator rounds them, are kept in `state_storages`."""
        local = [] if self.offload else [_local(t) for t in tensors]
        self.state_storages = tuple(int(t.untyped_storage().nbytes()) for t in local)
        return super().state_bytes(local)

    def watching(self, model: torch.nn.Module) -> ShardedStepTracer:
        """This tracer, labelling as gradients what autograd accumulates into the unsharded parameters of
        each unit of `model` (each forward pre-hook runs after FSDP's own, which has unsharded the unit; under
        tensor parallel an unsharded parameter is still a DTensor, of its tensor parallel group)."""
        sharded = {id(param) for param in model.parameters()}

        def hook(module: torch.nn.Module, *_: Any) -> None:
            for param in module.parameters():
                if id(param) not in sharded and param.requires_grad and id(param) not in self._hooked:
                    self._hooked.add(id(param))
                    param.register_post_accumulate_grad_hook(self._grad_hook)

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.register_forward_pre_hook(hook)
        return self

    def _grad_hook(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            StepTracer.label_live(self, [_local(param.grad)], MemoryCategory.GRADIENTS)

    def __enter__(self) -> ShardedStepTracer:
        self._entry_mode = active_fake_mode()
        self._original_resize = torch.UntypedStorage.resize_
        self._original_propagate = ShardingPropagator._propagate_tensor_meta_non_cached
        tracer = self

        def resize_(storage: torch.UntypedStorage, size: int) -> None:
            tracer._resize(storage, size)

        def propagate(propagator: ShardingPropagator, *args: Any, **kwargs: Any) -> Any:
            tracer._propagating = True
            try:
                return tracer._original_propagate(propagator, *args, **kwargs)
            finally:
                tracer._propagating = False

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign, assignment]
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        ShardingPropagator._propagate_tensor_meta_non_cached = self._original_propagate  # type: ignore[method-assign]
        super().__exit__(*args)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []
