"""Make a trace on CPU tensors keep what the same step keeps on a CUDA GPU.

The estimator traces on fake CPU tensors (fake CUDA tensors need a CUDA build for the
autograd engine). Where the CPU and CUDA code paths keep different tensors for backward,
the trace is steered onto the path whose saved tensors match CUDA's:

- dropout: CPU runs a composite that saves the mask in the input's dtype (4 B/element in
  fp32); CUDA runs `native_dropout`, which saves a bool mask (1 B/element). We call
  `native_dropout` explicitly.
- scaled_dot_product_attention: with dropout, CPU falls back to the math path, which keeps
  the [b, heads, s, s] probabilities; CUDA's flash and memory-efficient kernels keep only
  the output and a [b, heads, s] log-sum-exp (dropout is replayed from the RNG state). We
  call the CPU flash kernel, which keeps exactly those, on inputs cast as CUDA autocast
  casts them. With grouped-query heads (`enable_gqa`, which transformers passes when there
  is no mask) CUDA's flash kernel reads each key/value head for its group of query heads
  and keeps the key and value as given; the CPU kernel needs them repeated per query head,
  so the repeated copies are made unrecorded (`_GroupedQueryFlash`).
- optimizers: `foreach` is the default on CUDA only; the estimator passes it explicitly.
- cuBLAS: its workspace comes from the caching allocator at the first matrix product
  (see `hardware.cublas_workspace_bytes`).
- checkpoints offloaded to the host (transformers' activation_checkpointing_kwargs offload):
  `save_on_cpu` moves nothing where the tensors already are on the CPU; `saved_on_host` moves
  them out of the trace's (the device's) memory and back, as it does on a GPU.
- flash_attention_2 (traced as SDPA: `keys.traced_attention`) takes half-precision inputs only: transformers casts
  float32 queries, keys and values (PEFT's float32 norms and adapters make them so without autocast) to the autocast
  dtype, a quantized config's dtype or the first linear layer's (its own `get_target_dtype`) before the kernel;
  `flash_attention_casts` makes the traced SDPA do the same.
- grouped matrix products (Mixture-of-Experts' grouped_mm): torch's meta kernel, which fake tensors
  run, takes bfloat16 only; CUDA's `_grouped_mm_cuda` takes float32, bfloat16 and float16 (bf16 on a
  CUTLASS kernel on sm90/sm100, everything else as one mm per group into the same output:
  aten/src/ATen/native/cuda/GroupedBlas.cpp, GroupedMMUtils.h). `cuda_grouped_mm` gives the fake step
  CUDA's output for the other two.

Known limitations: CPU autocast's op lists differ slightly from CUDA's (a few ops run in a
different precision); kernels that pick an algorithm at run time (cuDNN, cuBLASLt) may
allocate their own workspaces, which are not modelled.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

_original_dropout = F.dropout
_original_sdpa = F.scaled_dot_product_attention


def _cuda_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    if not training or p == 0.0:
        return input
    out, _mask = torch.ops.aten.native_dropout(input, p, True)  # _mask: bool, kept for backward
    if inplace:
        return input.copy_(out)
    return out


Unrecorded = Callable[[], contextlib.AbstractContextManager[Any]]
"""Within its context, ops make tensors the trace does not count (the tracer's `paused`; nothing on a real step)."""


def repeat_heads(key: torch.Tensor, value: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value repeated to `heads` heads (grouped-query attention, as the CPU kernels need them); as they
    are where they have as many."""
    repeat = heads // key.shape[-3]
    if repeat == 1:
        return key, value
    return key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)


class _GroupedQueryFlash(torch.autograd.Function):
    """CUDA's flash kernel on grouped-query heads, no mask (PyTorch's sdp_utils.cpp, can_use_flash_attention:
    `backend_supports_grouped_query_attention = true`, ROCm aside). Backward keeps the query, the key and value as
    given, the output and the log-sum-exp; it computes the key and value gradients per query head and sums each group
    (flash_api.cpp, mha_bwd: `dk_expanded`, `dv_expanded`). On the H200, Llama-3.2-1B (32 query, 8 key/value heads)
    at 4 x 1,024 tokens peaked 381 MiB below a trace that kept the repeated key and value: 16 layers x 24 MiB."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool,
                scale: float | None, unrecorded: Unrecorded) -> torch.Tensor:
        with unrecorded():
            key_rep, value_rep = repeat_heads(key, value, query.shape[-3])
        out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key_rep, value_rep, 0.0, is_causal, scale=scale
        )
        ctx.save_for_backward(query, key, value, out, logsumexp)
        ctx.is_causal, ctx.scale, ctx.unrecorded = is_causal, scale, unrecorded
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, logsumexp = ctx.saved_tensors
        with ctx.unrecorded():
            key_rep, value_rep = repeat_heads(key, value, query.shape[-3])
        grad_query, grad_key_rep, grad_value_rep = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key_rep, value_rep, out, logsumexp, 0.0, ctx.is_causal, scale=ctx.scale
        )
        groups = (key.shape[-3], query.shape[-3] // key.shape[-3])
        grad_key = grad_key_rep.unflatten(-3, groups).sum(-3)
        grad_value = grad_value_rep.unflatten(-3, groups).sum(-3)
        return grad_query, grad_key, grad_value, None, None, None


def _cuda_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    unrecorded: Unrecorded = contextlib.nullcontext,
    ring: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    if attn_mask is not None and attn_mask.requires_grad:
        # A learned bias (T5's relative positions): the CPU flash kernel cannot give its
        # gradient; the math path keeps the probabilities, as CUDA's kernels then also may.
        return _original_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    if torch.is_autocast_enabled("cpu"):
        # CUDA autocast casts SDPA's inputs to the half dtype (its lower-precision list); called
        # as the aten op below, CPU autocast would not. Rotary embeddings make Llama's q and k fp32.
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(dtype) for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dtype)
    if ring is not None and attn_mask is None and value.shape[-1] == query.shape[-1]:
        return ring(query, key, value, scale, unrecorded)  # context parallel: `trace.step.context_parallel`
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        if attn_mask is None and value.shape[-1] == query.shape[-1]:
            return _GroupedQueryFlash.apply(query, key, value, is_causal, scale, unrecorded)
        key, value = repeat_heads(key, value, query.shape[-3])  # a mask: not the flash kernel
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # The fused kernels take an additive mask; a bool one is converted the same way.
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
    if value.shape[-1] != query.shape[-1]:
        # DeepSeek's multi-head latent attention: values narrower than queries and keys. CUDA's
        # flash kernel needs one head size, so SDPA runs the memory-efficient kernel (out and an
        # fp32 log-sum-exp kept for backward). It has no CPU kernel: fake tensors run its meta
        # kernel; real CPU tensors (tests) take the math path.
        if not isinstance(query, FakeTensor):
            return _original_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                  is_causal=is_causal, scale=scale)
        out, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, True, 0.0, is_causal, scale=scale
        )
        return out
    # Dropout is applied inside the fused CUDA kernels without keeping a mask, so the memory
    # is that of the kernel without dropout.
    out, _logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out


class _SavedOnHost(torch.autograd.graph.saved_tensors_hooks):
    """torch's save_on_cpu as it runs on a GPU, for `tracer`: what autograd saves is copied to the host (made
    while the tracer is paused: no device memory), the device's copy freed once nothing else holds it; backward
    copies it back (a device allocation)."""

    def __init__(self, tracer: Any, pin_memory: bool = True, device_type: str = "cuda") -> None:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            with tracer.paused():
                host = torch.empty_like(tensor)
                host.copy_(tensor)
            return host

        def unpack(host: torch.Tensor) -> torch.Tensor:
            return host.clone()

        super().__init__(pack, unpack)


@contextlib.contextmanager
def flash_attention_casts() -> Iterator[None]:
    """Within: transformers' SDPA attention function casts float32 queries, keys and values as its flash_attention_2
    function does (transformers' own `get_target_dtype` and `fa_peft_integration_check`), then runs as before."""
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.modeling_flash_attention_utils import fa_peft_integration_check
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def casting(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                *args: Any, **kwargs: Any) -> Any:
        query, key, value = fa_peft_integration_check(query, key, value, get_target_dtype(query, module))
        return sdpa(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = casting
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa


@contextlib.contextmanager
def saved_on_host(tracer: Any) -> Iterator[None]:
    """Within: transformers' checkpoints offloaded with save_on_cpu (its `offload`) leave the traced device."""
    from transformers import modeling_utils

    original = getattr(modeling_utils, "save_on_cpu", None)
    if original is None:  # a transformers that cannot offload checkpoints (passes.enable_checkpointing says so)
        yield
        return
    modeling_utils.save_on_cpu = lambda **kwargs: _SavedOnHost(tracer, **kwargs)  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        modeling_utils.save_on_cpu = original  # type: ignore[misc]


@contextlib.contextmanager
def cuda_code_paths(tracer: Any = None, ring: Callable[..., torch.Tensor] | None = None) -> Iterator[None]:
    """Within this context, dropout and SDPA take the paths that save what CUDA saves; `tracer`'s trace leaves out
    what only the CPU kernels need (a real step, without one, makes it); `ring`: SDPA's flash path under context
    parallel (`trace.step.context_parallel.ring_attention`)."""
    sdpa = functools.partial(_cuda_sdpa, unrecorded=tracer.paused if tracer is not None else contextlib.nullcontext,
                             ring=ring)
    functools.update_wrapper(sdpa, _original_sdpa)  # named as SDPA: torch's context parallel replaces it by its name
    F.dropout = _cuda_dropout  # type: ignore[assignment]
    F.scaled_dot_product_attention = sdpa  # type: ignore[assignment]
    try:
        yield
    finally:
        F.dropout = _original_dropout
        F.scaled_dot_product_attention = _original_sdpa


GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What CUDA's grouped matrix product takes (`_grouped_mm_validate_inputs`); the output is in mat_a's dtype."""
_GROUPED_MM = torch.ops.aten._grouped_mm.default


def _grouped_mm_output(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor CUDA's `_grouped_mm` returns (`create_grouped_gemm_output_tensor`): rows of its last dimension
    padded to 16 bytes for the TMA; the fallback writes each group's product into it, allocating nothing else."""
    if out_dtype not in (None, mat_a.dtype) or mat_a.dtype != mat_b.dtype or bias is not None:
        raise RuntimeError(f"grouped_mm: CUDA takes one dtype for both inputs and the output and no bias, got "
                           f"{mat_a.dtype}, {mat_b.dtype}, out_dtype={out_dtype}, bias={bias is not None}")
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if a_2d and b_2d:
        assert offs is not None  # [k, rows] @ [rows, n] split by group: [groups, k, n]
        size = [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]
    elif a_2d:
        size = [mat_a.shape[0], mat_b.shape[-1]]
    elif b_2d:
        size = [mat_a.shape[1], mat_b.shape[1]]
    else:
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
    alignment = 16 // mat_a.element_size()
    padded = -(-size[-1] // alignment) * alignment
    stride = [padded, 1] if len(size) == 2 else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=mat_a.dtype)


class _CudaGroupedMm(TorchDispatchMode):
    """Under fake tensors: `_grouped_mm` of float32 or float16 inputs answers as CUDA does (see the module)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _GROUPED_MM and args[0].dtype in GROUPED_MM_DTYPES and args[0].dtype != torch.bfloat16:
            return _grouped_mm_output(*args, **kwargs)
        return func(*args, **kwargs)


def cuda_grouped_mm() -> TorchDispatchMode:
    """A dispatch mode to enter right above the fake tensor mode (below the tracer, which sees the product and its
    output, not how it is made): grouped matrix products in every dtype CUDA takes."""
    return _CudaGroupedMm()


def fake_parameters(module: torch.nn.Module, fake_mode: Any) -> None:
    """Replace every meta parameter and buffer of `module` by a fake CPU tensor of the same shape."""
    replaced: dict[int, torch.nn.Parameter] = {}  # tied weights (lm_head = embeddings) stay tied
    with fake_mode:
        for sub in module.modules():
            for name, param in list(sub._parameters.items()):
                if param is not None and param.device.type == "meta":
                    if id(param) not in replaced:
                        fresh = torch.empty(param.shape, dtype=param.dtype)
                        replaced[id(param)] = torch.nn.Parameter(fresh, requires_grad=param.requires_grad)
                    sub._parameters[name] = replaced[id(param)]
            for name, buf in list(sub._buffers.items()):
                if buf is not None and buf.device.type == "meta":
                    sub._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype)
