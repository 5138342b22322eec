"""Liger Kernel's own autograd Functions, importable on a CPU without Triton or liger-kernel.

The pinned copies of liger-kernel 0.8.5's ops (tests/data/liger_kernel_0_8_5) are imported with
stub `triton` and `liger_kernel` packages: `@triton.jit` kernels become launchers that do nothing
(Triton kernels only write into tensors the Python allocated), and the helpers the ops import
are Liger's own (ops/utils.py) where they shape memory (`ensure_contiguous`, `calculate_settings`,
`amp_custom_fwd`), with the device taken as the CPU. Everything else the Functions do (which
tensors they allocate, in which dtype, what they save for backward) is Liger's code as shipped.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import operator
import sys
import types
from pathlib import Path
from typing import Any

import torch
from packaging.version import Version

PINNED = Path(__file__).parent / "data" / "liger_kernel_0_8_5"
LIGER_VERSION = "0.8.5"


class _Launcher:
    """A `@triton.jit` kernel: `kernel[grid](*args)` runs nothing."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return None


class _Anything:
    """tl.* in annotations and constants: any attribute, call or index is another one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return _Anything()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Anything()

    def __getitem__(self, key: Any) -> Any:
        return _Anything()


class _Constexpr:
    """triton.language.constexpr: a compile-time constant; `.value` is the Python value (Liger's casting modes)."""

    def __init__(self, value: Any = None) -> None:
        self.value = value


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def _next_power_of_2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length() if n > 0 else 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ensure_contiguous(fn: Any) -> Any:  # liger_kernel/ops/utils.py, as shipped
    @functools.wraps(fn)
    def wrapper(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        def maybe_to_contiguous(x: Any) -> Any:
            return x.contiguous() if isinstance(x, torch.Tensor) else x

        args = tuple(maybe_to_contiguous(arg) for arg in args)
        kwargs = {k: maybe_to_contiguous(v) for k, v in kwargs.items()}
        return fn(ctx, *args, **kwargs)

    return wrapper


def _calculate_settings(n: int) -> tuple[int, int]:  # liger_kernel/ops/utils.py, as shipped
    block = _next_power_of_2(n)
    warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, warps


def _stubs() -> dict[str, types.ModuleType]:
    language = _module("triton.language", constexpr=_Constexpr, **{n: _Anything() for n in (
        "float32", "float16", "bfloat16", "int64", "int32")})
    language.__getattr__ = lambda name: _Anything()  # type: ignore[attr-defined]
    libdevice = _module("triton.language.extra.libdevice", rsqrt=_Anything())
    extra = _module("triton.language.extra", libdevice=libdevice)
    triton = _module("triton", jit=_Launcher, cdiv=_cdiv, next_power_of_2=_next_power_of_2, language=language,
                     __version__="3.4.0")
    utils = _module(
        "liger_kernel.ops.utils", amp_custom_fwd=functools.partial(torch.amp.custom_fwd, device_type="cpu"),
        amp_custom_bwd=functools.partial(torch.amp.custom_bwd, device_type="cpu"), element_mul_kernel=_Launcher(None),
        is_hip=lambda: False, calculate_settings=_calculate_settings,
        compare_version=lambda package, op, target: op(Version("3.4.0"), Version(target)),
        device_context=lambda device: contextlib.nullcontext(), ensure_contiguous=_ensure_contiguous,
        get_npu_core_count=lambda: 1, set_large_grf_mode=lambda kwargs: None,
        torch_to_triton_dtype={torch.float32: None, torch.float16: None, torch.bfloat16: None})
    liger_utils = _module("liger_kernel.utils", infer_device=lambda: "cpu", is_npu_available=lambda: False,
                          infer_device_arch=lambda: "cpu")
    return {
        "triton": triton, "triton.language": language, "triton.language.extra": extra,
        "triton.language.extra.libdevice": libdevice,
        "liger_kernel": _module("liger_kernel", __path__=[]), "liger_kernel.functional": _module("liger_kernel.functional"),
        "liger_kernel.backends": _module("liger_kernel.backends", dispatch=None),
        "liger_kernel.ops": _module("liger_kernel.ops", __path__=[]),
        "liger_kernel.ops.cross_entropy": _module("liger_kernel.ops.cross_entropy",
                                                  liger_cross_entropy_kernel=_Launcher(None)),
        "liger_kernel.ops.utils": utils, "liger_kernel.utils": liger_utils,
    }


@functools.cache
def liger_ops() -> dict[str, types.ModuleType]:
    """The four pinned ops modules, by file stem, imported over the stubs (which are removed again)."""
    import torch.distributed.tensor  # noqa: F401 - what the ops import first, before the stub triton is in place

    saved = {name: sys.modules.get(name) for name in _stubs()}
    sys.modules.update(_stubs())
    try:
        modules = {}
        for stem in ("fused_linear_cross_entropy", "rms_norm", "swiglu", "rope"):
            spec = importlib.util.spec_from_file_location(f"pinned_liger_{stem}", PINNED / f"{stem}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            modules[stem] = module
        return modules
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


__all__ = ["LIGER_VERSION", "liger_ops", "operator"]
