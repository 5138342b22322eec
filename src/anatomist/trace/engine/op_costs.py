"""What one ATen op of a traced step costs: FLOPs, bytes moved, operation class.

FLOPs come from PyTorch's own per-op formulas (`torch.utils.flop_counter.flop_registry`: 2
FLOPs per multiply-add; matrix products, convolutions, attention), plus `CUSTOM_FLOPS` for
what it does not know (the CPU stand-ins of CUDA's attention kernels, Mixture-of-Experts'
grouped products); a stand-in of a fused kernel registers its op's formula in the registry itself
(`register_flop_formula`, as torch's own are). Ops without a formula get an approximate per-element count by class
(data/op_classes.toml). Bytes moved are input + output tensor bytes (0 for views), or what a stand-in of a fused
kernel states (`BYTES_FORMULAS`).
"""

from __future__ import annotations

import tomllib
from functools import cache
from importlib import resources
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

from anatomist.anatomy import OpClass, Phase
from anatomist.op_classes import base_name, classify, is_known, is_view
from anatomist.trace.engine.records import ATTENTION_PREFIX, NO_GEMM, Signature

_aten = torch.ops.aten


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
kernels and the grouped matrix product of Mixture-of-Experts layers. Pass it as
`FlopCounterMode(custom_mapping=CUSTOM_FLOPS)` to count the same way."""

_CUSTOM_FORMULAS = {k: shape_wrapper(v) for k, v in CUSTOM_FLOPS.items()}

BYTES_FORMULAS: dict[Any, Any] = {}
"""Bytes an op moves, for stand-ins of fused kernels whose traffic is not their tensors' (the chunks of a fused
loss re-read the head's weight): the op's packet -> f(*args, **kwargs), an int, or None for the tensors' bytes.
The stand-ins register themselves (`trace.standins.kernel_ops`)."""


@cache
def per_element_flops() -> dict[OpClass, int]:
    """Approximate FLOPs per output element of non-contraction ops (data/op_classes.toml)."""
    raw = tomllib.loads(resources.files("anatomist.data").joinpath("op_classes.toml").read_text())
    return {OpClass(k): int(v) for k, v in raw["flops_per_element"].items()}


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors in an ATen op's arguments or result, in order: tensors, nested in tuples, lists and
    (kwargs) dicts. torch's tree_flatten gives the same, at several times the cost (it handles
    every registered container): a fifth of a trace went into it."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in tensors_in(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in tensors_in(item)]
    return []


_GEMMS = frozenset(("mm", "addmm", "bmm", "baddbmm"))


def gemm_shape(name: str, inputs: list[torch.Tensor]) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a matrix product `name` whose tensor arguments are `inputs`, in order; zeros for other ops.

    mm and addmm multiply (m x k) by (k x n), bmm and baddbmm `batch` of them (a bias comes first); _scaled_mm (FP8)
    the first two, its scales after them. An attention
    kernel's first product is Q (Sq x D) by K transposed, over batch x heads (its backward takes the output's gradient
    first, then Q, K, V)."""
    if name in _GEMMS:
        a, b = inputs[-2:]
        if a.dim() == 2 and b.dim() == 2:
            return 1, a.shape[0], b.shape[1], a.shape[1]
        if a.dim() == 3 and b.dim() == 3:
            return a.shape[0], a.shape[1], b.shape[2], a.shape[2]
        return NO_GEMM
    if name == "_scaled_mm":  # FP8: (m x k) by (k x n), then their scales (and a bias)
        a, b = inputs[:2]
        return 1, a.shape[0], b.shape[1], a.shape[1]
    if name.startswith(ATTENTION_PREFIX) and len(inputs) >= 3:
        q, k = inputs[1:3] if name.endswith("_backward") else inputs[:2]
        if q.dim() == 4 and k.dim() == 4:
            return q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    return NO_GEMM


@cache
def _wraps(cls: type) -> bool:
    """Whether tensors of `cls` are wrapper subclasses (asked per type: the tracer asks of every tensor an op makes)."""
    return is_traceable_wrapper_subclass_type(cls)


def stored_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold `t`'s data: itself, or a wrapper subclass's inner tensors (torchao's float8 tensor: its
    float8 data and scale, where the wrapper reports the high-precision dtype and element size)."""
    if _wraps(type(t)):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        return [inner for name in names for inner in stored_tensors(getattr(t, name))]
    return [t]


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(s.numel() * s.element_size() for t in tensors for s in stored_tensors(t))


def op_signature(func: Any, args: Any, kwargs: Any, out: Any, phase: Phase) -> Signature:
    """The cost signature of one call of `func` in `phase` (see `Signature`)."""
    name = base_name(str(func.name()))
    inputs = tensors_in((args, kwargs))
    outputs = tensors_in(out)
    view = is_view(name) or bool(getattr(func, "is_view", False))
    packet = func._overloadpacket
    formula = _CUSTOM_FORMULAS.get(packet) or flop_registry.get(packet)
    flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
    op_class = OpClass.OTHER if phase is Phase.OPTIMIZER else classify(name)
    floating = [t for t in inputs if t.is_floating_point()] or [t for t in outputs if t.is_floating_point()]
    dtype = str(stored_tensors(floating[0])[0].dtype).removeprefix("torch.") if floating else "none"
    approx = 0
    if flops == 0 and not view and op_class is not OpClass.CONTRACTION:
        approx = per_element_flops().get(op_class, 0) * sum(t.numel() for t in outputs if t.is_floating_point())
    moved = 0
    stated = BYTES_FORMULAS.get(packet)
    stated_bytes = stated(*args, **kwargs) if stated is not None else None
    if stated_bytes is not None:
        moved = stated_bytes
    elif not view:
        moved = _nbytes(inputs) + _nbytes(outputs)
        if not outputs:  # in-place ops that return nothing (foreach): they write their first argument
            moved += _nbytes(tensors_in(args[0])) if args else 0
    gemm = gemm_shape(name, inputs) if flops else NO_GEMM
    return Signature(name, op_class, phase, dtype, flops, approx, moved, view, is_known(name), gemm)
