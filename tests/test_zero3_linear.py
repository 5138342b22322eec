"""The stand-in of DeepSpeed ZeRO-3's linear (trace/standins/zero3_linear.py) against DeepSpeed's own
`LinearFunctionForZeroStage3`: the same products and gradients, and the same tensors saved for backward, which for a
frozen weight is more than torch's linear saves. The memory it makes a ZeRO-3 LoRA step hold is checked against
DeepSpeed's own run in test_deepspeed_accuracy.py ("zero3, fp32, LoRA")."""

from __future__ import annotations

import pytest
import torch

from anatomist.trace.standins.zero3_linear import zero3_linear

deepspeed_linear = pytest.importorskip("deepspeed.runtime.zero.linear")


def _saved_bytes(run) -> int:
    """Bytes of the distinct storages autograd saves for backward while `run` runs."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


@pytest.mark.parametrize("shape", [(3, 5, 8), (4, 8)])
@pytest.mark.parametrize("frozen", [True, False])
def test_products_gradients_and_saves_are_deepspeeds(shape, frozen):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 8), requires_grad=not frozen)
    bias = torch.nn.Parameter(torch.randn(6), requires_grad=not frozen)
    x = torch.randn(*shape, requires_grad=True)

    def ours():
        with zero3_linear():
            return torch.nn.functional.linear(x, weight, bias)

    def deepspeeds():
        return deepspeed_linear.zero3_linear_wrap(x, weight, bias)

    results = []
    for run in (ours, deepspeeds):
        x.grad = weight.grad = bias.grad = None
        out = run()
        out.pow(2).sum().backward()
        results.append([t.detach().clone() if t is not None else None for t in (out, x.grad, weight.grad, bias.grad)])
    for a, b in zip(*results, strict=True):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-6))
    assert _saved_bytes(ours) == _saved_bytes(deepspeeds)
    if frozen:  # torch's own linear keeps no input for a frozen weight; ZeRO-3's does
        assert _saved_bytes(lambda: torch.nn.functional.linear(x, weight, bias)) < _saved_bytes(ours)
    assert torch.nn.functional.linear is not deepspeed_linear.zero3_linear_wrap
