"""Context parallel on the traced model, as the Trainer runs it under accelerate's ParallelismConfig(cp_size=C).

A recipe with `cp_size` C > 1 is traced as one rank of its world, FSDP over every GPU (accelerate shards over its
flattened `dp_shard_cp` mesh), the rank's part of each sequence: S / C tokens. What differs from any FSDP rank:
- the batch (`as_the_trainer_gives_it`): the Trainer shifts the labels beforehand and makes the position ids
  (`Trainer._prepare_context_parallel_inputs`), which torch's `context_parallel` then shards by sequence in place;
  its head-tail load balancing gives rank 0 the first and the last 1 / 2C of each sequence, so rank 0's positions
  jump and transformers builds a packed-sequence mask for them (`inputs.rows_not_packed` leaves that to it);
- the attention: accelerate's hooks (`_attach_context_parallel_hooks`, attached by `prepare`) drop the mask for
  `is_causal=True`, and SDPA runs PyTorch's ring attention over the C ranks of the group, its own functions
  (`_templated_ring_attention` forward, `_templated_ring_attention_backward`), each step of which calls the flash
  kernel on the rank's queries and one rank's keys and values (`ring_attention`): the keys and values gathered from
  the group (accelerate's default "allgather" rotation), the partial outputs merged in float32, the key and value
  gradients passed around the ring in float32. What a rank saves for backward is the flash kernel's own: its query,
  key and value, the merged output and log-sum-exp.

The group is a subgroup of PyTorch's fake process group (`ring_group`): the collectives return at once, with no data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from anatomist.errors import InputError
from anatomist.trace.engine.cuda_paths import repeat_heads

SEQ_DIM = 2
"""The sequence dimension of SDPA's [batch, heads, sequence, head_dim] inputs, which torch's ring rotates."""


def ring_group(cp_size: int) -> Any:
    """The process group of this rank's context parallel group: ranks 0 .. cp_size - 1 of the current (fake) world."""
    import torch.distributed as dist

    return dist.new_group(list(range(cp_size)))


def attach_hooks(model: torch.nn.Module) -> None:
    """accelerate's own hooks on the model's attention under context parallel: the mask dropped, `is_causal=True`."""
    try:
        from accelerate.big_modeling import _attach_context_parallel_hooks
    except ImportError as e:
        import accelerate

        raise InputError(f"context parallel: accelerate {accelerate.__version__} here has none (ParallelismConfig's "
                         "cp_size came in 1.10); upgrade accelerate") from e
    _attach_context_parallel_hooks(model)


def as_the_trainer_gives_it(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A causal LM's batch of one rank's tokens as the Trainer hands it to the model under context parallel (and under
    DeepSpeed's sequence parallel, whose data loader adapter makes the same keys): the labels shifted beforehand
    (`shift_labels`) and position ids, each of the rank's length."""
    return {**batch, "shift_labels": torch.empty_like(batch["labels"]), "position_ids": torch.empty_like(batch["input_ids"])}


def _flash(unrecorded: Callable[[], Any]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """One ring step's forward: the flash kernel on the queries and one rank's keys and values (grouped-query heads
    read per group, as CUDA's kernel reads them: the CPU kernel's repeated copies unrecorded)."""

    def op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool,
           scale: float | None = None) -> tuple[torch.Tensor, ...]:
        with unrecorded():
            key, value = repeat_heads(key, value, query.shape[-3])
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, scale=scale)

    return op


def _flash_backward(unrecorded: Callable[[], Any]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """One ring step's backward: the flash kernel's, the key and value gradients summed over each group of query
    heads (flash_api.cpp, mha_bwd: `dk_expanded`)."""

    def op(*, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
           logsumexp: torch.Tensor, is_causal: bool, scale: float | None = None) -> tuple[torch.Tensor, ...]:
        groups = (key.shape[-3], query.shape[-3] // key.shape[-3])
        with unrecorded():
            key, value = repeat_heads(key, value, query.shape[-3])
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale)
        if groups[1] == 1:
            return grads
        grad_query, grad_key, grad_value = grads
        return grad_query, grad_key.unflatten(-3, groups).sum(-3), grad_value.unflatten(-3, groups).sum(-3)

    return op


class _RingFlash(torch.autograd.Function):
    """SDPA under context parallel: torch's ring attention forward and backward around the flash kernel."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                group: Any, unrecorded: Callable[[], Any]) -> torch.Tensor:
        from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

        out, logsumexp, *_ = _templated_ring_attention(group, SEQ_DIM, _flash(unrecorded), query, key, value,
                                                       is_causal=True, scale=scale)
        ctx.save_for_backward(query, key, value, out, logsumexp)
        ctx.scale, ctx.group, ctx.unrecorded = scale, group, unrecorded
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention_backward,
        )

        query, key, value, out, logsumexp = ctx.saved_tensors
        grad_query, grad_key, grad_value, *_ = _templated_ring_attention_backward(
            ctx.group, SEQ_DIM, _flash_backward(ctx.unrecorded), grad_out=grad_out, grad_out_name="grad_out",
            query=query, key=key, value=value, out=out, logsumexp=logsumexp, is_causal=True, scale=ctx.scale)
        return grad_query, grad_key, grad_value, None, None, None


def ring_attention(group: Any) -> Callable[..., torch.Tensor]:
    """SDPA's flash path on this rank under context parallel (`cuda_paths.cuda_code_paths(ring=...)`): the
    queries, keys and values of its part of the sequence, causal (accelerate's hooks)."""

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
               unrecorded: Callable[[], Any]) -> torch.Tensor:
        return _RingFlash.apply(query, key.contiguous(), value.contiguous(), scale, group, unrecorded)

    return attend


@contextlib.contextmanager
def ring_options() -> Iterator[None]:
    """torch's context parallel options as accelerate sets them (`set_rotate_method("allgather")`, its default
    cp_comm_strategy) with load balancing (`context_parallel` turns it on where the sequence divides by 2C)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    options = _attention._cp_options
    saved = (options.rotate_method, options.enable_load_balance, options.convert_to_f32)
    options.rotate_method, options.enable_load_balance = _attention._RotateMethod.ALL_GATHER, True
    options.convert_to_f32 = True
    try:
        yield
    finally:
        options.rotate_method, options.enable_load_balance, options.convert_to_f32 = saved

