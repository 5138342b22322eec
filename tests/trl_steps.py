"""Real steps of TRL's own trainers on this CPU, measured by PyTorch's MemTracker: the independent side of
tests/test_trl_accuracy.py.

A trainer (SFTTrainer, DPOTrainer) is built as a user builds it, with a tiny model and a tokenizer made
here (no download), and one steady-state step runs as its training loop runs it: `training_step`
(compute_loss and backward), clipping, the optimizer step, zero_grad. What the GPU runs and this CPU
cannot is stood in for by code that keeps what the GPU's kernel keeps:

- TRL's fused LM head: on CUDA TRL scores only the labelled tokens (`_use_triton` in trl.trainer.utils)
  and folds each tile with a Triton kernel that allocates nothing; on a CPU it folds whole tiles in
  torch (several [tokens, 32768] fp32 temporaries). The CUDA path is taken, and the torch fold runs one
  row at a time (temporaries of one row: the kernel's registers).
- flash_attention_2's varlen kernel (padding-free batches): `VarlenAttention` keeps q, k, v, the output
  and an fp32 log-sum-exp per head and token, as flash-attn's does, running the CPU flash kernel per
  sequence (`cu_seq_lens_q`, which TRL's collator passes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from memtracker_step import steady_step_snapshots

from anatomist.trace.engine.cuda_paths import cuda_code_paths

VARLEN = "anatomist_varlen"
"""The attention implementation name the measured models use in place of flash_attention_2."""


def tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer of `vocab_size` tokens: <pad>, <unk>, </s>, then "t3".."tN" (no special token is a
    substring of a word: transformers splits added tokens out of the text first)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")


class VarlenAttention(torch.autograd.Function):
    """flash-attn's varlen forward/backward on [tokens, heads, dim] q, k, v split by cu_seqlens (causal)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int], scale: float
                ) -> torch.Tensor:
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            o, l_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                *(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), 0.0, True, scale=scale)
            out[a:b] = o[0].transpose(0, 1)
            lse[:, a:b] = l_[0]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.starts, ctx.scale = starts, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for a, b in zip(ctx.starts[:-1], ctx.starts[1:], strict=True):
            head = [t[a:b].transpose(0, 1)[None].contiguous() for t in (grad, q, k, v, out)]
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *head, lse[None, :, a:b].contiguous(), 0.0, True, scale=ctx.scale)
            dq[a:b], dk[a:b], dv[a:b] = (g[0].transpose(0, 1) for g in (gq, gk, gv))
        return dq, dk, dv, None, None


def _varlen_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                      dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: [1, heads, tokens, dim] in, [1, tokens, heads, dim] out (as flash's)."""
    starts = kwargs["cu_seq_lens_q"].tolist()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim] views
    out = VarlenAttention.apply(q, k, v, starts, scaling if scaling is not None else query.shape[-1] ** -0.5)
    return out[None], None


def register_varlen_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    AttentionInterface.register(VARLEN, _varlen_attention)
    AttentionMaskInterface.register(VARLEN, flash_attention_mask)


def _fold_rows(fold: Any) -> Any:
    """TRL's torch fold of a tile, one row at a time: what its Triton kernel holds (one row in registers)."""

    def per_row(tile: torch.Tensor, stride: int, targets: torch.Tensor, *rows: Any, **kwargs: Any) -> None:
        split = [i for i, r in enumerate(rows) if isinstance(r, torch.Tensor) and r.dim() == 1]
        for n in range(tile.shape[0]):
            picked = [r[n:n + 1] if i in split else r for i, r in enumerate(rows)]
            fold(tile[n:n + 1], stride, targets[n:n + 1], *picked, **kwargs)

    return per_row


@contextlib.contextmanager
def cuda_trl_paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """TRL's fused head on CUDA's path (see the module docstring), with CUDA's dropout and SDPA (`cuda_code_paths`)."""
    import trl.kernels.chunked_logprob as chunked
    import trl.trainer.utils as trl_utils

    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    monkeypatch.setattr(chunked, "_forward_tile", _fold_rows(chunked._forward_tile))
    monkeypatch.setattr(chunked, "_backward_tile", _fold_rows(chunked._backward_tile))
    with cuda_code_paths():
        yield


def measure_trainer_step(trainer: Any, batch: dict[str, Any], extra: tuple[torch.nn.Module, ...] = ()
                         ) -> tuple[dict[str, int], dict[str, int]]:
    """MemTracker's snapshots (at the peak, after the step) of one steady-state step of `trainer` on `batch`;
    `extra`: further models the step holds (DPO's reference)."""
    model = trainer.model
    args = trainer.args
    if args.activation_checkpointing:  # what Trainer.train() turns on before its loop (trainer.py, transformers 5)
        kwargs = {k: v for k, v in (args.activation_checkpointing_kwargs or {}).items()
                  if k not in ("every_n_layers", "offload")}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    optimizer = trainer.optimizer
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        trainer.training_step(model, batch)
        torch.nn.utils.clip_grad_norm_(params, trainer.args.max_grad_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return steady_step_snapshots(step, model, optimizer, *extra)
