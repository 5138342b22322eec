"""DeepSpeed ZeRO-3's linear, which its engine puts in place of `torch.nn.functional.linear` for the rest of the process
(deepspeed 0.19.8 `runtime/zero/partition_parameters.py` `_enable_mem_efficient_linear`, on by default:
zero_optimization.memory_efficient_linear; "this will persist unless manually reset"), as a stand-in of the same saves
and products (`runtime/zero/linear.py` `LinearFunctionForZeroStage3`): its forward saves the input, the weight and the
bias for backward whatever needs a gradient. torch's own linear saves its input only for the weight's gradient, so
under LoRA, whose base layers are frozen, ZeRO-3 keeps every base layer's input where torch keeps none (its weight is a
parameter: nothing more). DeepSpeed itself is not imported: an estimate needs none of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class _LinearForZeroStage3(torch.autograd.Function):
    """`LinearFunctionForZeroStage3`'s forward and backward, less the gathering of a partitioned weight (the estimate's
    ZeRO arithmetic counts gathered weights) and the autocast bookkeeping (DeepSpeed's mixed precision runs none)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        ctx.save_for_backward(input, weight, bias)
        if input.dim() == 2 and bias is not None:
            return torch.addmm(bias, input, weight.t())
        output = input.matmul(weight.t())
        if bias is not None:
            output += bias
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        dim = grad_output.dim()
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            if dim > 2:
                grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
            elif dim == 1:
                grad_weight = grad_output.unsqueeze(-1) * input.unsqueeze(0)
            else:
                grad_weight = grad_output.t().matmul(input)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output if dim == 1 else grad_output.sum(list(range(dim - 1)))
        return grad_input, grad_weight, grad_bias


def _zero3_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _LinearForZeroStage3.apply(input, weight, bias)


@contextlib.contextmanager
def zero3_linear() -> Iterator[None]:
    """`torch.nn.functional.linear` as a ZeRO-3 run has it, for this context (nn.Linear and PEFT's layers look it up at
    each call)."""
    original = torch.nn.functional.linear
    torch.nn.functional.linear = _zero3_linear
    try:
        yield
    finally:
        torch.nn.functional.linear = original
