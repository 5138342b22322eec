"""CUDA's autocast policy on a CPU-only torch, so a CPU trace saves what a CUDA step saves.

CPU and CUDA autocast cast different ops (PyTorch's autocast_mode.h/.cpp): on CUDA, softmax,
log_softmax, layer_norm, exp, pow, sum, the losses... run in fp32 and matrix products in the
half dtype; CPU autocast casts only a few dozen ops, mostly matrix products. So under
`torch.autocast("cpu")` an eager attention keeps bf16 probabilities where CUDA keeps fp32
ones. `cuda_autocast_policy()` registers, for the AutocastCPU dispatch key, kernels that
apply CUDA's policy (data/cuda_autocast.toml, transcribed from autocast_mode.h) for every op
of CUDA's lists, and fallthrough (no autocast kernel) for the ops only CPU autocast casts. Autocast runs
above autograd, so the casts are recorded and the tensors saved for backward get CUDA's
dtypes. Inside it, use `torch.autocast("cpu", dtype=...)` as usual.

Kept from CPU: its own kernels for the matrix products both policies cast to the half dtype
(`cpu_lower_precision_fp`), which cache the casts of weights as CUDA's do.

Known limitations: the `norm` overloads CUDA redispatches with an fp32 dtype argument are
cast to fp32 first (one more fp32 copy of the input than CUDA makes); ops CUDA registers
outside these lists (a few conv `.padding` overloads) keep CPU's behaviour.
"""

from __future__ import annotations

import contextlib
import tomllib
import warnings
from collections.abc import Callable, Iterator
from functools import cache
from importlib import resources
from typing import Any

import torch
from torch.utils._pytree import tree_map

_AUTOCAST_CPU = torch._C.DispatchKey.AutocastCPU


@cache
def cuda_policy() -> dict[str, tuple[str, ...]]:
    """The op lists of data/cuda_autocast.toml, by policy."""
    raw = tomllib.loads(resources.files("anatomist.data").joinpath("cuda_autocast.toml").read_text())
    return {name: tuple(ops) for name, ops in raw.items()}


def _eligible(value: Any) -> bool:
    """What autocast casts: floating-point tensors other than float64 (autocast_mode.h `is_eligible`)."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda v: v.to(dtype) if _eligible(v) and v.dtype != dtype else v, tree)


def _redispatch(op: Any, args: Any, kwargs: Any) -> Any:
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_AUTOCAST_CPU)):
        return op(*args, **kwargs)


def _lower_precision(op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = torch.get_autocast_dtype("cpu")
        return _redispatch(op, _cast(args, dtype), _cast(kwargs, dtype))

    return kernel


def _fp32(op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return _redispatch(op, _cast(args, torch.float32), _cast(kwargs, torch.float32))

    return kernel


def _fp32_set_opt_dtype(op: Any) -> Callable[..., Any]:
    """fp32 output where the first argument is eligible and no dtype was given (autocast_mode.h)."""
    names = [a.name for a in op._schema.arguments]
    position = names.index("dtype")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        given = args[position] if len(args) > position else kwargs.get("dtype")
        if given is None and args and _eligible(args[0]):
            if len(args) > position:
                args = (*args[:position], torch.float32, *args[position + 1:])
            else:
                kwargs = {**kwargs, "dtype": torch.float32}
        return _redispatch(op, args, kwargs)

    return kernel


def _promote(op: Any) -> Callable[..., Any]:
    """Every eligible argument to the widest floating dtype among them (autocast_mode.h `promote_type`)."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = torch.get_autocast_dtype("cpu")
        for value in torch.utils._pytree.tree_leaves((args, kwargs)):
            if _eligible(value):
                dtype = torch.promote_types(dtype, value.dtype)
        return _redispatch(op, _cast(args, dtype), _cast(kwargs, dtype))

    return kernel


_KERNELS = {"lower_precision_fp": _lower_precision, "fp32": _fp32, "fp32_set_opt_dtype": _fp32_set_opt_dtype,
            "promote": _promote}


def _op(name: str) -> Any:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _qualified(name: str) -> str:
    return f"aten::{name}"


@cache
def _cpu_only_ops() -> tuple[str, ...]:
    """Ops with a CPU autocast kernel that CUDA's policy does not cast: they must not be cast."""
    cuda = {_qualified(n) for names in cuda_policy().values() for n in names}
    return tuple(
        n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("aten::") and n not in cuda and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU")
    )


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """Within this context, `torch.autocast("cpu", ...)` casts as CUDA's autocast does."""
    policy = cuda_policy()
    keep = set(policy["cpu_lower_precision_fp"]) & set(policy["lower_precision_fp"])
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
            for kind, make in _KERNELS.items():
                for name in policy[kind]:
                    if name not in keep:
                        library.impl(name, make(_op(name)), "AutocastCPU")
            for name in _cpu_only_ops():
                # No autocast kernel, as on CUDA: a composite op (cross_entropy_loss) then
                # decomposes with autocast still on, and its parts (log_softmax, nll_loss) cast.
                library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        yield
    finally:
        library._destroy()
