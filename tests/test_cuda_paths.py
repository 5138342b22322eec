"""CUDA's code paths on CPU tensors (trace/engine/cuda_paths.py): grouped-query attention as CUDA's flash kernel runs
it, checked against PyTorch's own scaled_dot_product_attention (its CPU kernels, enable_gqa) on real tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from anatomist.trace.engine.cuda_paths import _original_sdpa, cuda_code_paths


def grouped(heads: int = 8, kv_heads: int = 2, requires_grad: bool = True) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    shapes = ((2, heads, 16, 32), (2, kv_heads, 16, 32), (2, kv_heads, 16, 32))
    return tuple(torch.randn(s, requires_grad=requires_grad) for s in shapes)


@pytest.mark.parametrize("is_causal", [True, False])
def test_grouped_query_attention_gives_pytorchs_result_and_gradients(is_causal: bool) -> None:
    q, k, v = grouped()
    expected = _original_sdpa(q, k, v, is_causal=is_causal, enable_gqa=True)
    grad = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    with cuda_code_paths():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    torch.testing.assert_close(out, expected)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def saved_shapes(run) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cuda_code_paths():
        run()
    return shapes


def test_backward_keeps_the_key_and_value_heads_as_given() -> None:
    """As CUDA's flash kernel: the query, the 2 key/value heads (not 8 repeated ones), the output, the log-sum-exp."""
    q, k, v = grouped()
    shapes = saved_shapes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert shapes == [(2, 8, 16, 32), (2, 2, 16, 32), (2, 2, 16, 32), (2, 8, 16, 32), (2, 8, 16)]


def test_a_mask_takes_the_repeated_heads() -> None:
    """With a mask CUDA's flash kernel does not run (nor does transformers ask for enable_gqa): the heads are
    repeated, and the result is still PyTorch's."""
    q, k, v = grouped()
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    expected = _original_sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    shapes = saved_shapes(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    assert (2, 8, 16, 32) in shapes[1:3] and (2, 2, 16, 32) not in shapes
    with cuda_code_paths():
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), expected)


@pytest.mark.parametrize(("attention", "dtype"), [("flash_attention_2", "bfloat16"), ("sdpa", "float32")])
def test_flash_attention_2_runs_on_what_transformers_casts_its_float32_inputs_to(tiny_model, attention, dtype):
    """QLoRA without autocast makes the attention's inputs float32 (bitsandbytes' default compute dtype, PEFT's float32
    norms): SDPA takes them so (CUDA's memory-efficient kernel), transformers' flash_attention_2 casts them to the
    quantized config's dtype (its `get_target_dtype`) before the kernel; the traced attention runs in that dtype."""
    from anatomist.estimate.time.ops import step_ops
    from anatomist.recipe import Recipe
    from anatomist.workload_loader import load_workload

    workload = load_workload(str(tiny_model("llama")), seq_len=32)
    recipe = Recipe.with_presets(dtype="bfloat16", peft="qlora", attn_implementation=attention).resolved(workload)
    attended = {r.dtype for r in step_ops(workload, recipe).records if "scaled_dot_product" in r.name}
    assert attended == {dtype}
