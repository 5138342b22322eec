"""FLOPs and bytes moved by every ATen op of one training step, counted on fake tensors.

The step is the one the memory estimator traces (`step.py`: forward under autocast,
backward, recomputation under gradient checkpointing, clipping, optimizer step), in its
two parts (the passes of one micro-batch; the optimizer phase), run on FAKE tensors, so no
GPU and no weights are needed. Two dispatch modes watch it:

- `torch.utils.flop_counter.FlopCounterMode`, PyTorch's own counter: its total is the
  step's FLOPs (matrix products, convolutions, attention; 2 FLOPs per multiply-add);
- `OpRecorder` (below), which uses the same per-op formulas (`flop_registry`) to give each
  op its FLOPs, its bytes read + written (input + output tensor bytes) and its phase.
  A test checks that both totals agree.

Depth: FLOPs, bytes and op counts are exactly linear in the number of repeated blocks, so
the step is traced at 1 and 2 blocks and extrapolated: n(L) = n1 + (L - 1)(n2 - n1).
Batch size: each op's FLOPs and bytes are affine in it, so batches above 3 are extrapolated
op by op from the traces at 2 and 3 (`_passes`). A plan of hundreds of recipes thus needs a
few traces per (checkpointing, precision, attention) and per optimizer.

Known limitations: the CPU code paths stand in for CUDA's (`cuda_model.cuda_code_paths`),
so a few ops differ from what CUDA runs (e.g. CPU's flash-attention kernel stands in for
the CUDA SDPA kernels; its FLOPs are counted with the same formula as CUDA's).
"""

from __future__ import annotations

import contextlib
import tomllib
from collections import Counter
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

from anatomist.anatomy import OpClass, Phase
from anatomist.estimate.cuda_model import cuda_code_paths, fake_parameters
from anatomist.estimate.step import (
    create_state,
    forward_backward,
    lower_dtype,
    model_at_depth,
    num_layers,
    optimizer_phase,
)
from anatomist.estimate.tracer import MemoryTracer
from anatomist.profile.classes import base_name, classify, is_known, is_view
from anatomist.recipe import Recipe
from anatomist.workload import Workload

_aten = torch.ops.aten
STEP_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


def _cpu_flash_flop(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """CPU flash attention: the same two batched products as CUDA's SDPA kernels."""
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward_flop(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _grouped_mm_flop(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """Mixture-of-Experts' grouped matrix product: every row of the input goes through one
    group's matrix, so the FLOPs are those of one (rows x k) @ (k x n) product. Backward's
    weight gradient is (k x rows) @ (rows x n) split by group into an (groups, k, n) output."""
    if len(a_shape) == 2 and len(b_shape) == 3:  # (rows, k) @ (groups, k, n)
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (k, rows) @ (rows, n) -> (groups, k, n)
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 3:  # (groups, m, k) @ (groups, k, n)
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    return 0


CUSTOM_FLOPS: dict[Any, Any] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flop,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flop,
    _aten._grouped_mm: _grouped_mm_flop,
}
"""FLOP formulas (on shapes) for what flop_counter does not know: the CPU stand-ins of CUDA
kernels and the grouped matrix product of Mixture-of-Experts layers."""

_FLOP_FORMULAS = {**flop_registry, **{k: shape_wrapper(v) for k, v in CUSTOM_FLOPS.items()}}


@cache
def per_element_flops() -> dict[OpClass, int]:
    """Approximate FLOPs per output element of non-contraction ops (data/op_classes.toml)."""
    raw = tomllib.loads(resources.files("anatomist.data").joinpath("op_classes.toml").read_text())
    return {OpClass(k): int(v) for k, v in raw["flops_per_element"].items()}


@dataclass(kw_only=True, slots=True, frozen=True)
class OpRecord:
    """All calls of one op with one signature in one phase: per-call cost and call count."""

    name: str
    """ATen base name, e.g. `addmm`, `native_layer_norm_backward`."""
    op_class: OpClass
    phase: Phase
    dtype: str
    """dtype of the op's first floating-point input (the precision its kernel runs in)."""
    flops: int
    """FLOPs of one call by flop_counter's formulas (0 for ops it does not count)."""
    approx_flops: int
    """FLOPs of one call of a non-contraction op, approximated per element (not in `flops`)."""
    bytes: int
    """Bytes one call reads and writes: input + output tensor bytes (0 for views)."""
    count: float
    """Calls per micro-batch (forward, backward) or per step (optimizer); extrapolated in depth."""
    view: bool
    known: bool
    """False when op_classes.toml does not list the op (it is then `other`)."""

    def calls_per_step(self, accumulation: int) -> float:
        """Calls in one optimizer step: the passes repeat per micro-batch, the optimizer step runs once."""
        return self.count * (1 if self.phase is Phase.OPTIMIZER else accumulation)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


Signature = tuple[Any, ...]
"""(name, class, phase, dtype, flops, approx_flops, bytes, view, known) of one op call."""
_COST_FIELDS = (4, 5, 6)
"""The signature's per-call costs: flops, approx_flops, bytes."""


class OpRecorder(MemoryTracer):
    """The estimator's tracer, also recording FLOPs and bytes of every op of the step."""

    def __init__(self, lower_precision_dtype: torch.dtype | None = None) -> None:
        super().__init__(lower_precision_dtype)
        self.ops: list[Signature] = []
        """The signature of every op of the step's phases, in call order."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.phase in STEP_PHASES:
            self.ops.append(self._signature(func, args, kwargs, out))
        return out

    def _signature(self, func: Any, args: Any, kwargs: Any, out: Any) -> Signature:
        name = base_name(str(func.name()))
        inputs = _tensors((args, kwargs))
        outputs = _tensors(out)
        view = is_view(name) or bool(getattr(func, "is_view", False))
        formula = _FLOP_FORMULAS.get(func._overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        op_class = OpClass.OTHER if self.phase is Phase.OPTIMIZER else classify(name)
        floating = [t for t in inputs if t.is_floating_point()] or [t for t in outputs if t.is_floating_point()]
        dtype = str(floating[0].dtype).removeprefix("torch.") if floating else "none"
        approx = 0
        if flops == 0 and not view and op_class is not OpClass.CONTRACTION:
            approx = per_element_flops().get(op_class, 0) * sum(t.numel() for t in outputs if t.is_floating_point())
        moved = 0
        if not view:
            moved = _nbytes(inputs) + _nbytes(outputs)
            if not outputs:  # in-place ops that return nothing (foreach): they write their first argument
                moved += _nbytes(_tensors(args[0])) if args else 0
        return (name, op_class, self.phase, dtype, flops, approx, moved, view, is_known(name))


@dataclass(kw_only=True, slots=True)
class StepOps:
    """The op records of one training micro-step plus optimizer step, at full depth."""

    records: list[OpRecord]
    counter_flops: float
    """FlopCounterMode's total for one micro-batch's forward + backward + one optimizer step."""

    def flops(self, phase: Phase | None = None) -> float:
        return sum(r.flops * r.count for r in self.records if phase is None or r.phase is phase)

    def flops_per_step(self, accumulation: int) -> int:
        """FLOPs of one optimizer step of `accumulation` micro-batches."""
        return round(accumulation * (self.flops(Phase.FORWARD) + self.flops(Phase.BACKWARD)) + self.flops(Phase.OPTIMIZER))

    def unknown_ops(self) -> list[str]:
        return sorted({r.name for r in self.records if not r.known})


Part = Literal["passes", "optimizer"]
_PART_FIELDS: dict[Part, tuple[str, ...]] = {
    "passes": ("gradient_checkpointing", "fp16", "bf16", "attn_implementation"),
    "optimizer": ("optim", "fp16", "max_grad_norm"),
}
"""Recipe fields that change each part's ops: recipes that differ only in the optimizer share
the passes' traces, and the other way round."""
BATCH_TRACES = (2, 3)
"""Batch sizes the passes are traced at when a larger one is asked for (not 1: at batch 1
some copies are views, so the op sequence differs from every larger batch)."""


@dataclass(frozen=True, slots=True)
class _Trace:
    ops: tuple[Signature, ...]
    """Signatures in call order."""
    counter_flops: int


_traces: dict[tuple[Any, ...], _Trace] = {}


def _trace(workload: Workload, recipe: Recipe, part: Part, depth: int, batch: int) -> _Trace:
    """The ops of one part of the step at `depth` blocks: the passes of one micro-batch of
    `batch` samples (forward, backward, recomputation), or the optimizer phase (unscale,
    clip, step) after a first step has made the state. Cached."""
    key = (
        *workload.trace_key(), part, tuple(getattr(recipe, f) for f in _PART_FIELDS[part]), depth,
        batch if part == "passes" else 0,
    )
    if key in _traces:
        return _traces[key]
    shallow = model_at_depth(workload, depth)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    attn = "sdpa" if recipe.attn_implementation == "flash_attention_2" else recipe.attn_implementation
    with torch.device("meta"), contextlib.redirect_stderr(None):
        model = shallow.build_model(attn)
    fake_parameters(model, fake_mode)
    lower = lower_dtype(recipe)
    recorder = OpRecorder(lower_precision_dtype=lower)
    params = list(model.parameters())
    counter = FlopCounterMode(display=False, custom_mapping=CUSTOM_FLOPS)
    with fake_mode, counter, recorder, cuda_code_paths():
        if part == "passes":
            autocast = torch.autocast("cpu", dtype=lower) if lower is not None else contextlib.nullcontext()
            one_micro_batch = recipe.replace(gradient_accumulation_steps=1)
            forward_backward(model, params, workload, one_micro_batch, batch, recorder, autocast)
        else:
            recorder.phase = Phase.SETUP
            optimizer, _ = create_state(params, recipe, recorder)
            for p in params:
                p.grad = torch.zeros_like(p)  # what backward leaves behind
            optimizer_phase(params, optimizer, recipe, recorder)
    _traces[key] = _Trace(ops=tuple(recorder.ops), counter_flops=counter.get_total_flops())
    return _traces[key]


def _passes(workload: Workload, recipe: Recipe, depth: int) -> _Trace:
    """The passes at the recipe's batch size: traced up to BATCH_TRACES[-1], extrapolated
    beyond. At any batch the passes run the same ops in the same order, and each op's FLOPs
    and bytes are affine in the batch size (weights fixed, activations per sample), so the
    two traces give every op's cost exactly. Where the sequences do not line up, it traces."""
    batch = recipe.per_device_train_batch_size
    if batch <= BATCH_TRACES[-1]:
        return _trace(workload, recipe, "passes", depth, batch)
    lo, hi = (_trace(workload, recipe, "passes", depth, b) for b in BATCH_TRACES)
    steps = batch - BATCH_TRACES[0]
    if len(lo.ops) != len(hi.ops):
        return _trace(workload, recipe, "passes", depth, batch)
    ops = []
    for a, b in zip(lo.ops, hi.ops, strict=True):
        if any(a[i] != b[i] for i in range(len(a)) if i not in _COST_FIELDS):
            return _trace(workload, recipe, "passes", depth, batch)
        ops.append(tuple(a[i] + steps * (b[i] - a[i]) if i in _COST_FIELDS else a[i] for i in range(len(a))))
    return _Trace(ops=tuple(ops), counter_flops=lo.counter_flops + steps * (hi.counter_flops - lo.counter_flops))


def _step_at_depth(workload: Workload, recipe: Recipe, depth: int) -> tuple[Counter[Signature], int]:
    """Call counts of every op signature of one micro-batch and one optimizer step, and
    FlopCounterMode's total, at `depth` blocks."""
    passes, optimizer = _passes(workload, recipe, depth), _trace(workload, recipe, "optimizer", depth, 0)
    return Counter(passes.ops) + Counter(optimizer.ops), passes.counter_flops + optimizer.counter_flops


_cache: dict[tuple[Any, ...], StepOps] = {}
_TRACE_FIELDS = ("per_device_train_batch_size", "gradient_checkpointing", "fp16", "bf16", "optim", "attn_implementation", "max_grad_norm")


def step_ops(workload: Workload, recipe: Recipe) -> StepOps:
    """Op records of one micro-batch (forward, backward) and one optimizer step, at full depth.

    Cached per model config and the recipe fields that change the ops (not accumulation:
    it repeats the micro-batch, which the time model multiplies).
    """
    key = (*workload.trace_key(), tuple(getattr(recipe, f) for f in _TRACE_FIELDS))
    if key not in _cache:
        _cache[key] = _step_ops(workload, recipe)
    return _cache[key]


def _step_ops(workload: Workload, recipe: Recipe) -> StepOps:
    layers = num_layers(workload)
    if layers <= 2:
        calls, total = _step_at_depth(workload, recipe, layers)
        records = [_record(sig, float(n)) for sig, n in calls.items()]
        counter_flops = float(total)
    else:
        c1, t1 = _step_at_depth(workload, recipe, 1)
        c2, t2 = _step_at_depth(workload, recipe, 2)
        records = _extrapolate(c1, c2, layers)
        counter_flops = float(t1 + (layers - 1) * (t2 - t1))
    records.sort(key=lambda r: (STEP_PHASES.index(r.phase), -r.flops * r.count, -r.bytes * r.count))
    return StepOps(records=records, counter_flops=counter_flops)


def _record(sig: tuple[Any, ...], count: float) -> OpRecord:
    name, cls, phase, dtype, flops, approx, moved, view, known = sig
    return OpRecord(name=name, op_class=cls, phase=phase, dtype=dtype, flops=flops, approx_flops=approx,
                    bytes=moved, count=count, view=view, known=known)


def _extrapolate(c1: Counter[tuple[Any, ...]], c2: Counter[tuple[Any, ...]], layers: int) -> list[OpRecord]:
    """Records at `layers` blocks from the traces at 1 and 2 blocks.

    An op whose per-call cost is the same at both depths (every op of a block, and those
    before and after the blocks) keeps its exact per-call cost; its count is linear in
    depth. An op whose per-call cost grows with depth (the optimizer's foreach kernels
    over all parameters) has its totals extrapolated and is costed at the mean per call.
    """
    def group(sig: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(v for i, v in enumerate(sig) if i not in _COST_FIELDS)

    groups: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    for sig in set(c1) | set(c2):
        groups.setdefault(group(sig), []).append(sig)
    records = []
    for key, sigs in groups.items():
        counts = {sig: c1.get(sig, 0) + (layers - 1) * (c2.get(sig, 0) - c1.get(sig, 0)) for sig in sigs}
        if all(n >= 0 for n in counts.values()):
            records.extend(_record(sig, float(n)) for sig, n in counts.items() if n > 0)
            continue
        totals = [0.0, 0.0, 0.0, 0.0]  # count, flops, approx_flops, bytes
        for sig in sigs:
            for i, (field, weight) in enumerate(((None, 1), *((f, 1) for f in _COST_FIELDS))):
                value = 1 if field is None else sig[field]
                totals[i] += value * (c1.get(sig, 0) + (layers - 1) * (c2.get(sig, 0) - c1.get(sig, 0))) * weight
        count = totals[0]
        if count <= 0:
            continue
        name, cls, phase, dtype, view, known = key
        mean = (name, cls, phase, dtype, round(totals[1] / count), round(totals[2] / count), round(totals[3] / count), view, known)
        records.append(_record(mean, count))
    return records


def flops_per_step(workload: Workload, recipe: Recipe) -> int:
    """FLOPs of one optimizer step: accumulation x (forward + backward (+ recompute)) + optimizer.

    Counted by PyTorch's flop_counter formulas on the real model code (2 FLOPs per
    multiply-add; matrix products, convolutions and attention only, the MFU convention).
    """
    return step_ops(workload, recipe).flops_per_step(recipe.gradient_accumulation_steps)
