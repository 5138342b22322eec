"""TRL's fused LM head on the traced model: a stand-in that allocates and saves what TRL's does.

TRL 1.x's SFTTrainer and DPOTrainer never build the logits: `add_fused_lm_head` (trl/trainer/utils.py)
patches the causal LM's forward so that `model(..., labels=..., fused_lm_head=True)` runs the
backbone and then `ChunkedLogProbFunction` (trl/kernels/chunked_logprob.py) on the hidden states of
the scored tokens: per-token log-probabilities (and the entropy, mean logit, top-1 flag the trainer
asks for) from [4,096 tokens x 32,768 vocabulary] tiles of the head's product, folded into
online-logsumexp statistics by a Triton kernel; backward recomputes each tile and accumulates the
gradients of the hidden states and of the head in fp32. Read from trl 1.16.0; on CUDA (where TRL
runs its Triton kernels: `_use_triton`):

- forward: the scored hidden states gathered ([tokens, hidden]: `hidden_states[mask]`), 7 fp32
  statistics per token, one tile buffer [min(tokens, 4096), 32768] in the compute dtype (autocast's,
  else the hidden states'), per token chunk the hidden states cast to it and per vocabulary chunk
  the head's rows cast to it; saves (hidden, weight, targets, log_z, entropy or log_z);
- backward: fp32 zeros for the gradient of the hidden states and (a trained head) of the weight,
  a tile buffer again, the same casts; the gradients cast back to the inputs' dtypes.

The Triton folds allocate nothing and stand as nothing here; every product is counted (one token
chunk by the products themselves, the others by `kernel_ops.fused_projection`). Every label is
taken as scored (a prompt the loss skips is scored here too: an upper bound on the per-token
buffers, which are small beside the backbone's).

Known limitation: the trace runs one token chunk of min(tokens, 4096) rows, affine in the batch only
while the traced batches (2 and 3) and the estimated one are on the same side of 4,096 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
from torch import Tensor

from anatomist.trace.standins.kernel_ops import fused_projection
from anatomist.trace.step.inputs import IGNORE_INDEX

TOKEN_CHUNK_SIZE = 4096
"""Tokens per projection tile (trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE, trl 1.16)."""
VOCAB_CHUNK_SIZE = 32768
"""Vocabulary rows per tile (trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE, trl 1.16)."""
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")
"""What SFTTrainer asks the head for (sft_trainer.py: add_fused_lm_head(..., outputs=...))."""
DPO_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")
"""What DPOTrainer asks the policy's head for (dpo_trainer.py); the reference model's computes log_probs only."""


class ChunkedLogProbFunction(torch.autograd.Function):
    """trl.kernels.ChunkedLogProbFunction on CUDA, without bias, temperature 1."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, outputs: tuple[str, ...]
                ) -> tuple[Tensor | None, ...]:
        ctx.set_materialize_grads(False)
        tokens, vocab = hidden.shape[0], weight.shape[0]
        compute = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else hidden.dtype
        running_max = torch.full((tokens,), float("-inf"), dtype=torch.float32)
        sum_exp, x_sum_exp, sq_sum_exp, z_sum = (torch.zeros((tokens,), dtype=torch.float32) for _ in range(4))
        max_before_target = torch.full((tokens,), float("-inf"), dtype=torch.float32)
        target_logit = torch.zeros((tokens,), dtype=torch.float32)
        rows = min(tokens, TOKEN_CHUNK_SIZE)
        mm_buf = torch.empty((rows, VOCAB_CHUNK_SIZE), dtype=compute)
        hidden_chunk = hidden[:rows].to(compute)
        for start in range(0, vocab, VOCAB_CHUNK_SIZE):
            end = min(start + VOCAB_CHUNK_SIZE, vocab)
            torch.mm(hidden_chunk, weight[start:end].to(compute).t(), out=mm_buf[:rows, : end - start])
        del hidden_chunk
        fused_projection(hidden, weight, tokens - rows, 1)  # the other token chunks' tiles
        log_z = running_max + torch.log(sum_exp)
        logprobs = target_logit - log_z
        entropy = log_z - x_sum_exp / sum_exp if "entropy" in outputs else None
        log_sum_sq_probs = torch.log(sq_sum_exp) - 2 * torch.log(sum_exp) if "log_sum_sq_probs" in outputs else None
        mean_logits = z_sum / vocab if "mean_logits" in outputs else None
        is_top1 = (target_logit >= running_max) & (target_logit > max_before_target) if "is_top1" in outputs else None
        ctx.save_for_backward(hidden, weight, targets, log_z, log_z if entropy is None else entropy)
        ctx.compute = compute
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq_probs, mean_logits, is_top1) if x is not None))
        del mm_buf
        return logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None, *_: Any) -> tuple[Any, ...]:
        hidden, weight, targets, log_z, entropy = ctx.saved_tensors
        needs_hidden, needs_weight = ctx.needs_input_grad[:2]
        tokens, vocab = hidden.shape[0], weight.shape[0]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32) if needs_weight else None
        rows = min(tokens, TOKEN_CHUNK_SIZE)
        mm_buf = torch.empty((rows, VOCAB_CHUNK_SIZE), dtype=ctx.compute)
        grad_logprobs = grad_logprobs.float().contiguous() if grad_logprobs is not None else None
        grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
        hidden_chunk = hidden[:rows].to(ctx.compute)
        w_chunk = None
        for start in range(0, vocab, VOCAB_CHUNK_SIZE):
            end = min(start + VOCAB_CHUNK_SIZE, vocab)
            w_chunk = weight[start:end].to(ctx.compute)  # the previous chunk's cast is freed after this one exists
            tile = mm_buf[:rows, : end - start]
            torch.mm(hidden_chunk, w_chunk.t(), out=tile)
            # the Triton kernel turns the tile into the logits' gradient in place; on CUDA the fp32 accumulations
            # are addmm(out_dtype=float32, out=...): in place
            products = int(grad_hidden is not None) + int(grad_weight is not None)
            if products:
                fused_projection(hidden_chunk, w_chunk, rows, products)
        del w_chunk, hidden_chunk, mm_buf
        fused_projection(hidden, weight, tokens - rows, 1 + int(needs_hidden) + int(needs_weight))
        return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
                grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None)


@dataclass
class FusedOutput:
    """What TRL's patched forward returns (trl's FusedCausalLMOutput): per-token fields, zero where unscored."""

    loss: Tensor
    log_probs: Tensor
    entropy: Tensor | None
    log_sum_sq_probs: Tensor | None
    mean_logits: Tensor | None
    is_top1: Tensor | None
    label_mask: Tensor


def _fused_forward(self: Any, *args: Any, fused_lm_head: bool = False, labels: Tensor | None = None,
                   num_items_in_batch: Any = None, anatomist_prompt_tokens: int = 0, **kwargs: Any) -> Any:
    """add_fused_lm_head's forward (trl/trainer/utils.py `_fused_forward`, the compact path TRL takes on CUDA);
    `anatomist_prompt_tokens`: the leading tokens of each row whose labels are -100 (DPO's prompt)."""
    if not fused_lm_head:
        return self._anatomist_original_forward(*args, labels=labels, **kwargs)
    assert labels is not None
    kwargs["use_cache"] = False
    backbone = self.base_model(*args, **kwargs)
    hidden_states = backbone.last_hidden_state[:, :-1]
    labels = labels[:, 1:]
    mask = labels != IGNORE_INDEX
    # hidden_states[mask], labels[mask]: every label after the prompt scored (the module's docstring); a copy of each
    first = max(anatomist_prompt_tokens - 1, 0)
    scored_hidden = hidden_states[:, first:].reshape(-1, hidden_states.shape[-1])
    scored_labels = labels[:, first:].reshape(-1)
    per_token = ChunkedLogProbFunction.apply(scored_hidden, self.get_output_embeddings().weight, scored_labels,
                                             self._anatomist_outputs)
    scattered = [None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in per_token]
    log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = scattered
    assert log_probs is not None
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / count
    return FusedOutput(loss=loss, log_probs=log_probs, entropy=entropy, log_sum_sq_probs=log_sum_sq_probs,
                       mean_logits=mean_logits, is_top1=is_top1, label_mask=mask)


def add_fused_lm_head(model: torch.nn.Module, outputs: tuple[str, ...] = ("log_probs",)) -> None:
    """Patch a causal LM (PEFT's base model, where wrapped) as trl's add_fused_lm_head does."""
    wrapper: Any = model
    base: Any = wrapper.get_base_model() if hasattr(wrapper, "get_base_model") else wrapper
    base._anatomist_original_forward = base.forward
    base._anatomist_outputs = outputs
    base.forward = MethodType(_fused_forward, base)
