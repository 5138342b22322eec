"""Cut Cross-Entropy's own Python (the fork axolotl installs), importable on a CPU without Triton.

The pinned copies (tests/data/cut_cross_entropy_5f0c7a7) are imported as the package `cut_cross_entropy` over stub
`triton` modules and stub `tl_autotune` / `tl_utils` modules (the Triton helpers, which only shape kernels): every
kernel becomes a launcher that does nothing (Triton kernels only write into tensors the Python allocated, as
liger_source.py explains). Everything the wrappers and the autograd Function do (which tensors they allocate, in
which dtype, what they save for backward) is the fork's code as shipped. `sort_logit_avg`, which the fork compiles
with torch.compile, runs as the function it compiles.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from pathlib import Path
from typing import Any

import torch
from liger_source import _Anything, _cdiv, _Constexpr, _Launcher, _module

PINNED = Path(__file__).parent / "data" / "cut_cross_entropy_5f0c7a7"
CCE_COMMIT = "5f0c7a7"


def _identity_decorator(*args: Any, **kwargs: Any) -> Any:
    return lambda fn: fn


def _stubs() -> dict[str, types.ModuleType]:
    language = _module("triton.language", constexpr=_Constexpr)
    language.__getattr__ = lambda name: _Anything()  # type: ignore[attr-defined]
    triton = _module("triton", jit=_Launcher, heuristics=_identity_decorator, cdiv=_cdiv, language=language,
                     __version__="3.4.0")
    package = _module("cut_cross_entropy", __path__=[str(PINNED)])
    vocab_parallel = _module("cut_cross_entropy.vocab_parallel", __path__=[str(PINNED / "vocab_parallel")])
    autotune = _module("cut_cross_entropy.tl_autotune", cce_forward_autotune=_identity_decorator,
                       cce_backward_autotune=_identity_decorator, indexed_dot_autotune=_identity_decorator)
    tl_utils = _module("cut_cross_entropy.tl_utils", b_bin_fn=lambda b: 0,
                       is_triton_greater_or_equal_3_2_0=lambda: True)
    tl_utils.__getattr__ = lambda name: _Anything()  # type: ignore[attr-defined]
    return {"triton": triton, "triton.language": language, "cut_cross_entropy": package,
            "cut_cross_entropy.vocab_parallel": vocab_parallel, "cut_cross_entropy.tl_autotune": autotune,
            "cut_cross_entropy.tl_utils": tl_utils}


@functools.cache
def cce_module() -> types.ModuleType:
    """The pinned `cut_cross_entropy.cce` (with `cce_linear_cross_entropy`), imported over the stubs, which are
    removed again with every module the import added."""
    torch.compile(fullgraph=True)(lambda x: x)  # what the fork's decorators import, before the stub triton is in place
    before = set(sys.modules)
    saved = {name: sys.modules.get(name) for name in _stubs()}
    sys.modules.update(_stubs())
    try:
        module = importlib.import_module("cut_cross_entropy.cce")
        module.sort_logit_avg = module.sort_logit_avg._torchdynamo_orig_callable
        return module
    finally:
        for name in set(sys.modules) - before:
            if name.startswith(("cut_cross_entropy", "triton")):
                del sys.modules[name]
        for name, stub in saved.items():
            if stub is not None:
                sys.modules[name] = stub
