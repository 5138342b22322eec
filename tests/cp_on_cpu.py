"""PyTorch's context parallel (ring attention) on the CPU, for the measured side of the context parallel tests.

`torch.distributed.tensor.experimental.context_parallel` turns SDPA's inputs into DTensors sharded by sequence and
lets DTensor hand the fused attention kernels to its ring algorithm (`_templated_ring_attention` forward,
`_templated_ring_attention_backward`), but it knows CUDA's kernels only (`custom_ops`: flash, memory-efficient,
cuDNN); on the CPU SDPA runs `_scaled_dot_product_flash_attention_for_cpu`, which DTensor has no strategy for.
`cpu_ring_attention` registers that kernel and its backward with the same ring functions, as torch registers the
CUDA flash kernel (`_scaled_dot_product_ring_flash_attention` and its backward): the ring, its rotations, its merge
in float32 and its load balancing are PyTorch's; only the kernel each step calls is the CPU's.

What the CPU kernel differs in: it takes the key and value with as many heads as the query (no grouped-query
heads: CUDA's flash kernel reads them per group), so a model measured here has as many key/value heads as query
heads.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

_aten = torch.ops.aten
_FORWARD = _aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2
RING_CALLS: Counter[str] = Counter()
"""How many times the ring ran, "forward" and "backward": a measurement says its attention was the ring's."""


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The CPU flash kernel (or its backward) on DTensors sharded by sequence: torch's ring over their mesh."""
    mesh = next(a.device_mesh for a in args if isinstance(a, DTensor))
    group = mesh.get_group()
    local = [_local(a) for a in args]
    kwargs = {k: _local(v) for k, v in kwargs.items()}
    RING_CALLS["forward" if op_call is _FORWARD else "backward"] += 1
    if op_call is _FORWARD:
        query, key, value, *rest = local
        dropout_p, is_causal = (rest + [0.0, False][len(rest):])[:2]
        results = cp_attention._templated_ring_attention(
            group, SEQ_DIM, _FORWARD, query, key, value, is_causal=is_causal, dropout_p=dropout_p,
            scale=kwargs.get("scale"))
    else:
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = local[:8]
        results = cp_attention._templated_ring_attention_backward(
            group, SEQ_DIM, _BACKWARD, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key,
            value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p,
            scale=kwargs.get("scale"))
    return tuple(DTensor.from_local(r, mesh, [Shard(SEQ_DIM)], run_check=False) for r in results)


def cpu_ring_attention() -> None:
    """Register the CPU flash kernel and its backward with torch's context parallel (idempotent)."""
    cp_attention.custom_ops[_FORWARD] = _handler
    cp_attention.custom_ops[_BACKWARD] = _handler
