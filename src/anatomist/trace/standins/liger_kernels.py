"""Liger Kernel on the traced model: stand-ins that allocate and save what Liger's kernels do.

Liger's kernels are Triton: they run on neither a CPU nor fake tensors. What they do to memory
is in their Python, which this module follows line by line for liger-kernel 0.8.5 (the version
data/liger.toml names):

- `LigerRMSNormFunction` (src/liger_kernel/ops/rms_norm.py): forward allocates Y (x's dtype) and
  RSTD ([rows], fp32 in the "llama" casting mode) and saves (X as [rows, hidden], W, RSTD); backward
  writes dX over dY (in_place=True) and reduces dW through an fp32 [SM count, hidden] buffer.
- `LigerSiLUMulFunction` (ops/swiglu.py, LigerSwiGLUMLP's down_proj(silu(gate) * up)): forward
  allocates c and saves (a, b) as [rows, intermediate]; backward writes the gradients over a and b.
- `LigerRopeFunction` (ops/rope.py, liger_rotary_pos_emb): rotates q and k in place, saves (cos, sin);
  backward rotates the incoming gradients in place.
- `LigerFusedLinearCrossEntropyFunction` (ops/fused_linear_cross_entropy.py, reduction "mean",
  the causal-LM forward of transformers/model/llama.py `lce_forward` and `LigerForCausalLMLoss`):
  forward allocates the gradient of the hidden states ([tokens, hidden], their dtype), of the head
  weight (its shape and dtype, where it is trained) and an fp32 loss per token, then runs the
  tokens in chunks: each chunk's logits [chunk, vocabulary] (the product's dtype), turned into their
  gradient in place, multiplied back into both gradients; the full logits never exist. It saves
  the two gradients; backward only scales them in place.

Each stand-in is a `torch.autograd.Function` doing those allocations (with torch's own ops, so
autocast and the tracer see them as on the GPU) and calling `kernel_ops`' custom ops where the
kernel computes. tests/test_liger.py runs Liger's own Functions (from a pinned copy of their
source, their Triton launches skipped) beside these and compares what each saves and allocates.

Known limitations:
- The fused cross-entropy's chunk: Liger takes next_power_of_2(ceil(tokens / ceil(V / H))) tokens a
  chunk; the trace takes batch x ceil(seq / ceil(V / H)), which is affine in the batch (as every
  traced figure must be) and up to half of Liger's: the logits of one chunk, at most one more
  [tokens x hidden] tensor in the product's dtype, can be missing at the loss's peak.
- The chunk's FLOPs are counted for every chunk; the trace runs one chunk and the others as one
  `fused_projection` op, which states what their kernels move per token (the Triton cross-entropy kernel's reads
  and writes of the logits included), and one `chunk_weight_pass`, what one chunk moves of the head's weight and
  its gradient, which the time model repeats for every chunk of Liger's own size at the recipe's batch
  (`estimate.time.ops`): 32 chunks of Llama-3.2-1B at 4 x 1,024 tokens read its 525 MB head 64 times.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import MethodType
from typing import Any

import torch
from torch import Tensor

from anatomist.axes.liger import flce_chunk_tokens, liger_table
from anatomist.trace.standins.kernel_ops import chunk_weight_pass, fused_projection
from anatomist.trace.step.inputs import IGNORE_INDEX, loss_from_hidden_states


class RMSNormFunction(torch.autograd.Function):
    """LigerRMSNormFunction, casting mode "llama" (RSTD in fp32), in place."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
        x = x.contiguous()  # ensure_contiguous
        shape = x.shape
        x = x.view(-1, shape[-1])
        y, rstd = torch.ops.anatomist.rms_norm(x, weight, eps, offset, True)
        ctx.offset = offset
        ctx.save_for_backward(x, weight, rstd)
        return y.view(*shape)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        dy = dy.contiguous()  # ensure_contiguous
        shape = dy.shape
        dy = dy.view(-1, shape[-1])
        needs_dw = ctx.needs_input_grad[1]
        rows = liger_table().rms_norm_backward_rows if needs_dw else 1
        partial = torch.empty((rows, shape[-1]), dtype=torch.float32) if needs_dw else dy.new_empty((1, shape[-1]))
        torch.ops.anatomist.rms_norm_backward(dy, x, weight, rstd, ctx.offset, partial)
        dw = partial.sum(dim=0).to(weight.dtype) if needs_dw else None
        return dy.view(*shape), dw, None, None


class SiLUMulFunction(torch.autograd.Function):
    """LigerSiLUMulFunction: c = silu(a) * b; saves a and b; backward overwrites them with their gradients."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
        a, b = a.contiguous(), b.contiguous()  # ensure_contiguous
        shape = a.shape
        a, b = a.view(-1, shape[-1]), b.view(-1, shape[-1])
        c = torch.ops.anatomist.swiglu(a, b)
        ctx.save_for_backward(a, b)
        return c.view(*shape)

    @staticmethod
    def backward(ctx: Any, dc: Tensor) -> tuple[Tensor, Tensor]:
        dc = dc.contiguous()  # ensure_contiguous
        a, b = ctx.saved_tensors
        shape = dc.shape
        torch.ops.anatomist.swiglu_backward(dc.view(-1, shape[-1]), a, b)
        return a.view(*shape), b.view(*shape)


class RopeFunction(torch.autograd.Function):
    """LigerRopeFunction: q, k ([batch, heads, seq, head_dim]) rotated in place; saves cos and sin."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = _rope_angles(cos, sin)
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        torch.ops.anatomist.rope(q, k, cos, sin, False)
        ctx.save_for_backward(cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, dq: Tensor, dk: Tensor) -> tuple[Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
        torch.ops.anatomist.rope(dq, dk, cos.contiguous(), sin.contiguous(), True)
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None


def _rope_angles(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """rope_forward's reshaping of cos and sin to [batch or 1, seq, dim]."""
    if cos.ndim == 4:
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return cos, sin


def liger_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Any = None,
                         unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """What Liger puts in place of a model's `apply_rotary_pos_emb`."""
    return RopeFunction.apply(q, k, cos, sin)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """LigerFusedLinearCrossEntropyFunction with reduction "mean", no bias, no class weights.

    `chunk` tokens of `hidden` ([tokens, H]) run as Liger runs every chunk; the products of the other
    tokens are one `fused_projection`. `sm80`: the GPU has compute capability 8.0 or more, where Liger
    accumulates the head's gradient with addmm(out_dtype=float32) instead of an [V, H] product and its
    fp32 copy.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")  # amp_custom_fwd: the forward runs under the caller's autocast
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, target: Tensor, chunk: int, sm80: bool) -> Tensor:
        tokens = hidden.shape[0]
        input_needs_grad = hidden.requires_grad
        grad_input = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if input_needs_grad and weight.requires_grad else None
        loss_1d = torch.zeros(tokens, dtype=torch.float32)
        target_mask = target != IGNORE_INDEX  # kept until the end; Liger then reads its sum with .item()
        hidden_chunk = hidden[:chunk]
        # Liger writes into a preallocated [chunk, V] buffer only without autograd's autocast (mm out=)
        mm_out = not torch.is_autocast_enabled("cpu") and hidden.dtype == weight.dtype
        logits_storage = torch.empty((chunk, weight.shape[0]), dtype=hidden.dtype) if mm_out else None
        if logits_storage is not None:
            logits_chunk = torch.mm(hidden_chunk, weight.t(), out=logits_storage)
        else:
            logits_chunk = hidden_chunk @ weight.t()
        logits_chunk = logits_chunk.contiguous()
        # the cross-entropy kernel writes the loss per token and turns the logits into their gradient in place
        grad_logits_chunk = logits_chunk
        del logits_chunk
        if input_needs_grad:
            if mm_out and grad_logits_chunk.dtype == grad_input.dtype:
                torch.mm(grad_logits_chunk, weight, out=grad_input[:chunk])
            else:
                grad_input[:chunk] = grad_logits_chunk @ weight
        half = (torch.float16, torch.bfloat16)
        in_place = (grad_weight is not None and sm80 and grad_logits_chunk.dtype in half
                    and grad_weight.dtype in (torch.float32, grad_logits_chunk.dtype))
        if in_place and grad_weight is not None:
            # addmm(grad_weight, grad_logits.t(), input, out=grad_weight[, out_dtype=float32]): in place
            cast = hidden_chunk.to(grad_logits_chunk.dtype) if hidden_chunk.dtype != grad_logits_chunk.dtype else hidden_chunk
            moved = _nbytes(cast) + _nbytes(grad_logits_chunk) + 2 * _nbytes(grad_weight)
            fused_projection(cast, grad_weight, cast.shape[0], 1, moved)
            del cast
        elif grad_weight is not None:
            grad_weight += torch.mm(grad_logits_chunk.t(), hidden_chunk).float()
        logit_size = grad_logits_chunk.element_size()
        del grad_logits_chunk, hidden_chunk, logits_storage
        _other_chunks(hidden, weight, grad_weight, chunk, logit_size, input_needs_grad, in_place)
        loss = torch.sum(loss_1d)
        del loss_1d, target_mask
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None)
        return loss

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grad_input, grad_weight = ctx.saved_tensors
        # Liger scales both in place (element_mul_kernel) unless grad_output is 1
        return grad_input, grad_weight, None, None, None


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _other_chunks(hidden: Tensor, weight: Tensor, grad_weight: Tensor | None, chunk: int, logit_size: int,
                  input_grad: bool, in_place: bool) -> None:
    """The ops standing for the chunks after the traced one: their products as one `fused_projection` (with what
    they move per token, and the traced chunk's cross-entropy kernel, which is no torch op), and one chunk's pass
    over the head's weight, `chunk_weight_pass`, which the time model repeats for each of Liger's chunks."""
    tokens, vocab = hidden.shape[0], weight.shape[0]
    products = 1 + int(input_grad) + int(grad_weight is not None)
    per_token = _chunk_bytes_per_token(hidden, vocab, logit_size, input_grad, grad_weight is not None)
    cross_entropy = (3 if input_grad else 1) * chunk * vocab * logit_size
    fused_projection(hidden, weight, tokens - chunk, products, (tokens - chunk) * per_token + cross_entropy)
    chunk_weight_pass(weight, _weight_pass_bytes(weight, grad_weight, logit_size, input_grad, in_place))


def _weight_pass_bytes(weight: Tensor, grad_weight: Tensor | None, logit_size: int, input_grad: bool,
                       in_place: bool) -> int:
    """What one chunk moves of the head's weight and its gradient: the weight read by the logits' product and by the
    hidden state gradient's (in the product's dtype), and under autocast cast for the first of them (`weight.t()` is
    a view, which autocast's cache does not keep); the weight's gradient read and written by addmm in place
    (`in_place`, sm80 with half logits), else the [V, H] product written, made float32 where it is half, and added
    (both read, the gradient written)."""
    elements = weight.numel()
    reads = (1 + int(input_grad)) * elements * logit_size
    if weight.element_size() != logit_size:
        reads += elements * (weight.element_size() + logit_size)
    if grad_weight is None:
        return reads
    if in_place:
        return reads + 2 * _nbytes(grad_weight)
    made_float = elements * (logit_size + 4) if logit_size != 4 else 0
    return reads + elements * logit_size + made_float + elements * 4 + 2 * _nbytes(grad_weight)


def _chunk_bytes_per_token(hidden: Tensor, vocab: int, logit_size: int, input_grad: bool, weight_grad: bool) -> int:
    """What one token of a chunk moves besides the head's weight (ops/fused_linear_cross_entropy.py's loop): its hidden
    row read into the logits' product, its logits written, read and written by the cross-entropy kernel (twice read
    and once written with gradients: max and sum, then the gradient in place; once read without), read again by the
    product into the hidden state's gradient (whose row it writes) and by the one into the weight's (which reads the
    hidden row again)."""
    row, logits = hidden.shape[1] * hidden.element_size(), vocab * logit_size
    grads = int(input_grad) + int(weight_grad)
    return row * (1 + grads) + logits * (1 + (3 if input_grad else 1) + grads)


def lce_forward(self: Any, input_ids: Tensor | None = None, labels: Tensor | None = None, **kwargs: Any) -> Any:
    """Liger's causal-LM forward (transformers/model/llama.py `lce_forward`) in training with labels: the fused linear
    cross-entropy of the backbone's last hidden states (labels shifted by LigerForCausalLMLoss: padded with -100, then
    sliced); else the model's own forward."""

    def loss_of(hidden_states: Tensor, labels: Tensor) -> Tensor:
        batch, seq_len, hidden = hidden_states.shape
        padded = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)  # alive through the loss, as Liger's
        shift_labels = padded[..., 1:].contiguous()
        weight = self.lm_head.weight
        chunk = flce_chunk_tokens(batch, seq_len, hidden, weight.shape[0])
        return FusedLinearCrossEntropyFunction.apply(hidden_states.view(-1, hidden), weight, shift_labels.view(-1),
                                                     chunk, self._anatomist_sm80)

    return loss_from_hidden_states(self, input_ids, labels, kwargs, loss_of)


def _rms_norm_forward(self: Any, hidden_states: Tensor) -> Tensor:
    eps = getattr(self, "variance_epsilon", None) or getattr(self, "eps", None) or 1e-6
    return RMSNormFunction.apply(hidden_states, self.weight, eps, 0.0)


def _swiglu_mlp_forward(self: Any, x: Tensor) -> Tensor:
    return self.down_proj(SiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


@contextlib.contextmanager
def liger_kernels(model: torch.nn.Module, model_type: str, compute_capability: str, *, fused_loss: bool = True,
                  ) -> Iterator[None]:
    """Patch `model` (a causal LM, or PEFT's wrapper of one) as the Trainer's use_liger_kernel=True does
    (`_apply_liger_kernel_to_instance` on the base model): every RMSNorm and SwiGLU MLP of the backbone,
    the causal LM's forward (`fused_loss`: TRL's trainers turn it off for their own fused head), and, while
    inside, the model module's `apply_rotary_pos_emb`."""
    wrapper: Any = model
    base: Any = wrapper.get_base_model() if hasattr(wrapper, "get_base_model") else wrapper
    backbone: Any = getattr(base, base.base_model_prefix, base)
    for module in backbone.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = MethodType(_rms_norm_forward, module)
        elif kind.endswith("MLP") and all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")):
            module.forward = MethodType(_swiglu_mlp_forward, module)
    if fused_loss:
        base._anatomist_sm80 = int(compute_capability.split(".")[0]) >= 8
        base.forward = MethodType(lce_forward, base)
    modeling: Any = importlib.import_module(liger_table().modelled[model_type])
    original = modeling.apply_rotary_pos_emb
    modeling.apply_rotary_pos_emb = liger_rotary_pos_emb
    try:
        yield
    finally:
        modeling.apply_rotary_pos_emb = original
