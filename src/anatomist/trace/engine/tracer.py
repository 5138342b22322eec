"""Record every tensor allocation and free of a step, with its phase and category, and the
cost of every op.

`StepTracer` is a TorchDispatchMode: each ATen op's outputs are inspected and a new storage
becomes an allocation event; a weakref callback on the storage becomes the free event. With
`record_ops`, each op of the step's phases also leaves its cost signature (FLOPs, bytes,
class: `op_costs.op_signature`), so one trace serves the memory and the time prediction. It works
the same on fake tensors (prediction: shapes only, no data, no device) and on real ones
(measurement on CPU).

Categories are settled after the fact, as PyTorch's mem_tracker does: an allocation made in
forward and still alive when forward ends is an activation; a storage that ends up as a
`.grad` is a gradient; one that ends up in `optimizer.state` is optimizer state.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from anatomist.anatomy import STEP_PHASES, MemoryCategory, Phase
from anatomist.trace.engine.allocator import round_size
from anatomist.trace.engine.op_costs import op_signature, stored_tensors, tensors_in
from anatomist.trace.engine.records import Allocation, Event, Signature, Trace

_aten = torch.ops.aten
DEVICE_QUERY = torch.ops.prim.device.default
"""What a fake tensor's `.device` becomes in C++ (autograd's and each op's device checks): more than half the calls
of a step, none a kernel or an allocation; passed straight on, unrecorded."""


def _storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class StepTracer(TorchDispatchMode):
    """Watches storages appear and die while a step runs, and (optionally) what each op costs.

    Args:
        lower_precision_dtype: dtype of the autocast copies of fp32 weights; casts of a
            registered weight into it are counted as weights (the seeds' 6 B/param).
        record_ops: also record the cost signature of every op of the first micro-batch's
            forward and backward and of the optimizer step (`Trace.ops`).
    """

    def __init__(self, lower_precision_dtype: torch.dtype | None = None, *, record_ops: bool = False) -> None:
        super().__init__()
        self.record_ops = record_ops
        self.trace = Trace()
        self.phase = Phase.SETUP
        self.segment = "pre"
        self.block = -1
        """Which repeated block runs (in the "blocks" segment), else -1."""
        self.micro_step = 0
        self.second_micro_batch: tuple[int, int] | None = None
        """(events, op count) when the second micro-batch began (None: it did not)."""
        self._ids = itertools.count()
        self._live: dict[int, tuple[int, weakref.ref[Any]]] = {}  # storage key -> (alloc_id, ref)
        self._weight_keys: set[int] = set()
        self._lower_dtype = lower_precision_dtype
        self._paused = 0

    # -- compiled code (trace/step/compiled.py) ---------------------------------------------
    @property
    def is_paused(self) -> bool:
        return self._paused > 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within: ops run unrecorded, their tensors neither allocated nor costed (the values inside a
        fused kernel, the tracing of a compiled graph)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def kernels(self, ops: tuple[tuple[Any, ...], ...]) -> Iterator[None]:
        """Within: the ops' tensors are recorded but not their costs; on leaving, `ops` (signatures less
        their phase: one per compiled kernel) are recorded in the current phase instead."""
        recording, self.record_ops = self.record_ops, False
        try:
            yield
        finally:
            self.record_ops = recording
        if self.record_ops and self.micro_step == 0 and self.phase in STEP_PHASES:
            self.trace.ops.extend(Signature(op[0], op[1], self.phase, *op[2:]) for op in ops)

    # -- registration of what exists before the step -------------------------------
    def register(self, tensor: torch.Tensor, category: MemoryCategory) -> None:
        """Count an already-existing tensor (parameters, buffers) under `category`: the storages that hold it (a
        wrapper subclass's inner tensors', as torchao's float8-gathered weight)."""
        for inner in stored_tensors(tensor):
            st = _storage_of(inner)
            if st is None or st._cdata in self._live:
                continue
            alloc_id = self._add(st, st._cdata)
            self.set_category(alloc_id, category)
            if category is MemoryCategory.WEIGHTS:
                self._weight_keys.add(st._cdata)

    def allocate_extra(self, nbytes: int, category: MemoryCategory) -> int:
        """An allocation that has no tensor here (e.g. the cuBLAS workspace); never freed."""
        alloc_id = next(self._ids)
        self.trace.allocations[alloc_id] = Allocation(alloc_id, nbytes, self.phase, category, True)
        self.trace.events.append(Event(alloc_id, nbytes, self.phase, self.segment, self.micro_step, self.block))
        return alloc_id

    def begin_micro_batch(self, micro: int) -> None:
        self.micro_step = micro
        if micro == 1:
            self.second_micro_batch = (len(self.trace.events), self.trace.op_count)

    # -- labelling -------------------------------------------------------------------
    def set_category(self, alloc_id: int, category: MemoryCategory) -> None:
        alloc = self.trace.allocations[alloc_id]
        alloc.category = category
        alloc.fixed = True

    def label_live(self, tensors: list[torch.Tensor], category: MemoryCategory) -> None:
        """Settle the category of the live storages behind `tensors`."""
        for inner in (s for t in tensors for s in stored_tensors(t)):
            st = _storage_of(inner)
            if st is not None and st._cdata in self._live:
                self.set_category(self._live[st._cdata][0], category)

    def label_phase_survivors(self, phase: Phase, category: MemoryCategory) -> None:
        """Every storage made in `phase` and still alive, not yet settled, becomes `category`."""
        for alloc_id, _ in self._live.values():
            alloc = self.trace.allocations[alloc_id]
            if alloc.phase is phase and not alloc.fixed:
                alloc.category = category
                alloc.fixed = True

    def state_bytes(self, tensors: list[torch.Tensor]) -> int:
        """Device bytes of the storages behind `tensors` (the optimizer state), as the allocator rounds them."""
        return sum(round_size(t.untyped_storage().nbytes()) for t in tensors)

    def allocation_of(self, tensor: torch.Tensor) -> int | None:
        """The id of the live allocation behind `tensor` (ids are never reused, unlike storage addresses), or None."""
        st = _storage_of(tensor)
        entry = self._live.get(st._cdata) if st is not None else None
        return entry[0] if entry is not None else None

    def live_bytes(self) -> int:
        return sum(self.trace.allocations[a].nbytes for a, _ in self._live.values())

    def stop(self) -> None:
        """The step is over: a storage that dies from now on (the model, whenever the collector frees its
        reference cycles) is no event of it. Dropping the weakrefs drops their callbacks."""
        self._live.clear()

    # -- the dispatch hook -------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._paused or func is DEVICE_QUERY or _on_meta(kwargs):
            return func(*args, **kwargs)
        self.trace.op_count += 1
        out = func(*args, **kwargs)
        is_weight_cast = (
            func is _aten._to_copy.default
            and self._lower_dtype is not None
            and isinstance(args[0], torch.Tensor)
            and (st := _storage_of(args[0])) is not None
            and st._cdata in self._weight_keys
        )
        # A wrapper subclass (torchao's float8 tensor) holds no memory of its own: its inner tensors do, and a view of
        # it (detach, t) wraps views of them; counted by the wrapper's own storage, each view was a new allocation.
        for stored in (s for t in tensors_in(out) for s in stored_tensors(t)):
            st = _storage_of(stored)
            if st is None or st._cdata in self._live:
                continue
            alloc_id = self._add(st, st._cdata)
            self.trace.allocations[alloc_id].op = func.__name__
            if is_weight_cast:
                self.set_category(alloc_id, MemoryCategory.WEIGHTS)
        if self.record_ops and self.micro_step == 0 and self.phase in STEP_PHASES:
            self.trace.ops.append(op_signature(func, args, kwargs, out, self.phase))
        return out

    def _add(self, st: torch.UntypedStorage, key: int) -> int:
        alloc_id = next(self._ids)
        nbytes = int(st.nbytes())
        self.trace.allocations[alloc_id] = Allocation(alloc_id, nbytes, self.phase)
        self.trace.events.append(Event(alloc_id, nbytes, self.phase, self.segment, self.micro_step, self.block))
        ref = weakref.ref(st, self._freed_callback(key))
        self._live[key] = (alloc_id, ref)
        return alloc_id

    def _freed_callback(self, key: int) -> Any:
        def freed(_ref: Any) -> None:
            entry = self._live.pop(key, None)
            if entry is not None:
                alloc = self.trace.allocations[entry[0]]
                self.trace.events.append(Event(entry[0], -alloc.nbytes, self.phase, self.segment, self.micro_step, self.block))

        return freed


def _on_meta(kwargs: dict[str, Any]) -> bool:
    """Whether an op makes a tensor on the meta device, which holds no memory and runs no kernel (transformers' tensor
    parallel layers make one to read a shape's strides)."""
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"
