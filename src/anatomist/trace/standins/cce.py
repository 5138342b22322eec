"""Cut Cross-Entropy on the traced model: a stand-in that allocates and saves what CCE's kernels do.

Cut Cross-Entropy (Wijmans et al. 2024, apple/ml-cross-entropy) computes a causal LM's loss from the last hidden
states and the head's weight without the logits: a Triton kernel takes each token's log-sum-exp over the vocabulary
block by block, and the backward kernel recomputes the blocks to write the two gradients. What it does to memory is
its Python, which this module follows for the version axolotl installs (axolotl-ai-cloud/ml-cross-entropy at
5f0c7a7, `estimate.llm_notes.MODELLED_CCE`; the Apple release on PyPI is older and allocates otherwise), as its
transformers patch runs it (`cce_patch(model)`, defaults: impl "cce", reduction "mean", filter_eps "auto", no fp32
accumulation):

- `linear_cross_entropy(e, c, labels, shift=True)` (cce.py `cce_linear_cross_entropy`): the scored tokens are every
  token but the last of each row whose next label is not -100, found with nonzero (utils.py `_build_flat_valids`:
  a bool mask, an int64 [K, 2] index, its int32 copy, scaled in place and summed to int64 [K]);
- `LinearCrossEntropyFunction.forward`: the log-sum-exp lse (fp32 [K]) with its locks (uint32 [K / 128]), the
  average logit per vocabulary row (fp32 [V], for the backward's filter), the target's logit (fp32 [K], the loss
  per token once lse is added in place), the mean; saved: the hidden states [tokens, H], the weight, lse, the labels,
  the index and the averages;
- backward: the vocabulary order (argsort of the averages, int32 [V]), the hidden states' gradient (zeros_like,
  their dtype) and the weight's where it is trained (its dtype), each with int32 locks of [rows / 128, H / 64].

The kernels themselves keep nothing in device memory but those tensors. `StandIn` makes the same allocations with
torch's ops (so the tracer sees them) and carries the kernels' FLOPs as `kernel_ops.fused_projection`: the
forward's product over the vocabulary, the backward's recomputed product and the product of each gradient.

Known limitations:
- The backward skips vocabulary blocks whose softmax is below filter_eps; its FLOPs are counted as if it skipped
  none (an upper bound of the compute).
- Every label is scored (the traced batch has no -100 beyond each row's last token): K = rows x (seq - 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import MethodType
from typing import Any

import torch
from torch import Tensor

from anatomist.errors import InputError
from anatomist.trace.standins.kernel_ops import fused_projection
from anatomist.trace.step.inputs import IGNORE_INDEX, loss_from_hidden_states

HALF = (torch.float16, torch.bfloat16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class StandIn(torch.autograd.Function):
    """`LinearCrossEntropyFunction` (reduction "mean", filter_eps set, no bias, no vocabulary parallelism) on the
    hidden states `e` [tokens, H], the head's weight `c` [V, H], the labels `targets` [tokens] and the scored
    tokens' index `valids` [K]."""

    @staticmethod
    def forward(ctx: Any, e: Tensor, c: Tensor, targets: Tensor, valids: Tensor) -> Tensor:
        scored = valids.shape[0]
        lse = e.new_full((scored,), -float("inf"), dtype=torch.float32)
        locks = e.new_full((_cdiv(scored, 128),), 0, dtype=torch.uint32)
        logit_avg = e.new_full((c.shape[0],), 0.0, dtype=torch.float32) if e.requires_grad or c.requires_grad else None
        fused_projection(e, c, scored, 1)  # cce_lse_forward_kernel: every scored token against every row of c
        del locks
        neg_dot = e.new_zeros((scored,), dtype=torch.float32)  # indexed_neg_dot_forward_kernel
        nll = neg_dot.add_(lse)
        loss = nll.mean()
        ctx.save_for_backward(e, c, lse, targets, valids, logit_avg)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        e, c, lse, _targets, valids, logit_avg = ctx.saved_tensors
        vocab_ordering = torch.argsort(logit_avg).to(torch.int32) if logit_avg is not None else None
        grad_out = grad_out.contiguous()
        de = torch.zeros_like(e) if ctx.needs_input_grad[0] else None
        dc = torch.zeros_like(c) if ctx.needs_input_grad[1] else None
        d_blocks = _cdiv(c.shape[1], 64)
        de_locks = e.new_zeros((_cdiv(valids.shape[0], 128), d_blocks), dtype=torch.int32) if de is not None else None
        dc_locks = c.new_zeros((_cdiv(c.shape[0], 128), d_blocks), dtype=torch.int32) if dc is not None else None
        # _cce_backward_kernel: the product recomputed block by block, and the product of each gradient
        fused_projection(e, c, valids.shape[0], 1 + int(de is not None) + int(dc is not None))
        del vocab_ordering, de_locks, dc_locks
        return de, dc, None, None


def linear_cross_entropy(e: Tensor, c: Tensor, labels: Tensor) -> Tensor:
    """`linear_cross_entropy(e, c, labels, shift=True)` of the hidden states `e` [rows, seq, H]: the scored tokens'
    index built as `_build_flat_valids` builds it, then `StandIn`."""
    if e.dtype not in HALF or c.dtype not in HALF:
        raise InputError(f"Cut Cross-Entropy's backward takes bfloat16 or float16 hidden states and head weights "
                         f"(cce_backward_kernel asserts it); here they are {str(e.dtype)[6:]} and {str(c.dtype)[6:]}: "
                         "load the weights in bfloat16 (--dtype bfloat16), or leave cut_cross_entropy off")
    e = e.contiguous()
    targets = labels.contiguous()
    shifted = targets[..., 1:]
    mask = shifted != IGNORE_INDEX
    rows = mask.shape[0] * mask.shape[1]  # every label scored: nonzero's [K, 2] without reading the labels
    index = e.new_empty((rows, 2), dtype=torch.int64)
    del mask
    valids = index.to(torch.int32)
    del index
    valids[:, 0] *= shifted.stride(0)
    valids = valids.sum(1)
    return StandIn.apply(e.flatten(0, -2), c, targets.flatten(), valids)


def cce_forward(self: Any, input_ids: Tensor | None = None, labels: Tensor | None = None, **kwargs: Any) -> Any:
    """The causal-LM forward `cce_patch` puts in place (transformers/llama.py `cce_forward`) in training with labels:
    Cut Cross-Entropy of the backbone's last hidden states and the head's weight; else the model's own."""
    return loss_from_hidden_states(self, input_ids, labels, kwargs,
                                   lambda hidden_states, labels: linear_cross_entropy(hidden_states, self.lm_head.weight,
                                                                                      labels))


@contextlib.contextmanager
def cut_cross_entropy(model: torch.nn.Module) -> Iterator[None]:
    """Patch `model` (a causal LM, or PEFT's wrapper of one) as `cce_patch` does: its forward scores the tokens with
    Cut Cross-Entropy.

    Raises:
        InputError: a model without the backbone (`model`) and head (`lm_head`) the patched forward reads.
    """
    wrapper: Any = model
    base: Any = wrapper.get_base_model() if hasattr(wrapper, "get_base_model") else wrapper
    if not (hasattr(base, "model") and hasattr(base, "lm_head")):
        raise InputError(f"cut_cross_entropy: {type(base).__name__} has no backbone `model` and head `lm_head`, "
                         "which Cut Cross-Entropy's transformers patch reads; leave cut_cross_entropy off")
    base.forward = MethodType(cce_forward, base)
    try:
        yield
    finally:
        del base.forward
