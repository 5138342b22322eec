"""Custom ops standing for fused GPU kernels a CPU torch cannot run (Liger Kernel's Triton kernels).

A fused kernel writes into tensors its caller allocated, or allocates its outputs itself, and
keeps nothing else. Each op here does what the kernel does to memory (the outputs it returns are
new storages, the tensors it writes in place are declared mutated) and nothing more, so the
tracer (`tracer.StepTracer`) records exactly the kernel's allocations and one op with the kernel's
reads and writes. On fake tensors only their fake implementation runs; the CPU implementations
compute the kernel's result in plain torch (used where a stand-in runs on real tensors, in tests).

`fused_projection` carries the FLOPs of matrix products a fused kernel runs without allocating
their full outputs (the chunks of a fused linear + cross-entropy): a 0-dimensional result and
the FLOPs of `products` products of `tokens` rows of `hidden` with every row of `weight`,
registered with `torch.utils.flop_counter` as its own formulas are (which `trace.engine.op_costs` reads).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from anatomist.trace.engine.op_costs import BYTES_FORMULAS
from anatomist.trace.engine.records import CHUNK_WEIGHT_PASS

_NAMESPACE = "anatomist"


@torch.library.custom_op(f"{_NAMESPACE}::fused_projection", mutates_args=())
def fused_projection(hidden: Tensor, weight: Tensor, tokens: int, products: int, moved: int = -1) -> Tensor:
    """`products` matrix products of `tokens` rows x hidden with weight [rows, hidden]^T, kept nowhere. `moved`: the
    bytes its kernels read and write, where the caller knows them (-1: its tensors' bytes, read once)."""
    return hidden.new_zeros((), dtype=torch.float32)


@fused_projection.register_fake
def _(hidden: Tensor, weight: Tensor, tokens: int, products: int, moved: int = -1) -> Tensor:
    return hidden.new_empty((), dtype=torch.float32)


@register_flop_formula(torch.ops.anatomist.fused_projection)
def _projection_flops(hidden: Any, weight: Any, tokens: int, products: int, *args: Any, out_shape: Any = None,
                      **kwargs: Any) -> int:
    """2 FLOPs per multiply-add (flop_counter's convention): products x tokens x hidden x weight rows."""
    return 2 * products * tokens * hidden[-1] * weight[0]


@torch.library.custom_op(CHUNK_WEIGHT_PASS, mutates_args=())
def chunk_weight_pass(weight: Tensor, moved: int) -> Tensor:
    """What one chunk of a chunked loss moves of the head's weight and its gradient, `moved` bytes (no FLOPs: the
    chunk's products are in a `fused_projection`). One call stands for one chunk: the time model repeats it for
    the chunks of the recipe's batch (`estimate.time.ops`)."""
    return weight.new_zeros((), dtype=torch.float32)


@chunk_weight_pass.register_fake
def _(weight: Tensor, moved: int) -> Tensor:
    return weight.new_empty((), dtype=torch.float32)


def _projection_bytes(hidden: Any, weight: Any, tokens: int, products: int, moved: int = -1) -> int | None:
    return moved if moved >= 0 else None


def _pass_bytes(weight: Any, moved: int) -> int:
    return moved


BYTES_FORMULAS[torch.ops.anatomist.fused_projection] = _projection_bytes
BYTES_FORMULAS[torch.ops.anatomist.chunk_weight_pass] = _pass_bytes



@torch.library.custom_op(f"{_NAMESPACE}::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float, rstd_fp32: bool) -> tuple[Tensor, Tensor]:
    """Liger's RMSNorm forward on rows of `x`: (y in x's dtype, 1/rms per row)."""
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + eps)
    y = (x.float() * rstd[:, None]) * (offset + weight.float())
    return y.to(x.dtype), rstd.to(torch.float32 if rstd_fp32 else x.dtype)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float, offset: float, rstd_fp32: bool) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32 if rstd_fp32 else x.dtype)


@torch.library.custom_op(f"{_NAMESPACE}::rms_norm_backward", mutates_args=("dy", "dw_rows"))
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float, dw_rows: Tensor) -> None:
    """Liger's RMSNorm backward: dx written over dy (in place), the weight gradient's partial sums in dw_rows."""
    xf, rs, g = x.float(), rstd.float()[:, None], dy.float()
    normed = xf * rs
    wg = g * (offset + weight.float())
    dx = rs * (wg - normed * (wg * normed).mean(-1, keepdim=True))
    dw_rows.zero_()
    dw_rows[0] = (g * normed).sum(0)
    dy.copy_(dx.to(dy.dtype))


@rms_norm_backward.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float, dw_rows: Tensor) -> None:
    return None


@torch.library.custom_op(f"{_NAMESPACE}::swiglu", mutates_args=())
def swiglu(a: Tensor, b: Tensor) -> Tensor:
    """Liger's SwiGLU forward: silu(a) * b, in a's dtype."""
    return (torch.nn.functional.silu(a.float()) * b.float()).to(a.dtype)


@swiglu.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    return torch.empty_like(a)


@torch.library.custom_op(f"{_NAMESPACE}::swiglu_backward", mutates_args=("a", "b"))
def swiglu_backward(dc: Tensor, a: Tensor, b: Tensor) -> None:
    """Liger's SwiGLU backward: the gradients of a and b written over a and b (in place)."""
    af, bf, g = a.float(), b.float(), dc.float()
    sig = torch.sigmoid(af)
    silu = af * sig
    da = g * bf * (sig + silu * (1 - sig))
    b.copy_((g * silu).to(b.dtype))
    a.copy_(da.to(a.dtype))


@swiglu_backward.register_fake
def _(dc: Tensor, a: Tensor, b: Tensor) -> None:
    return None


@torch.library.custom_op(f"{_NAMESPACE}::rope", mutates_args=("q", "k"))
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> None:
    """Liger's RoPE on q [b, s, heads, d] and k in place; backward rotates the other way."""
    sign = -1.0 if backward else 1.0
    c, s = cos[:, :, None, :].to(q.dtype), sign * sin[:, :, None, :].to(q.dtype)
    for t in (q, k):
        half = t.shape[-1] // 2
        rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
        t.copy_(t * c + rotated * s)


@rope.register_fake
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> None:
    return None
