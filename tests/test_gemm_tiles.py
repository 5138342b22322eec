"""Matrix products by their shapes: the traced (batch, m, n, k) of every product, and the share of the GPU that
shape keeps busy (NVIDIA's tile and wave quantization, `estimate.time.tiles`)."""

from __future__ import annotations

import dataclasses

import pytest

from anatomist.estimate.time.device import peak_seconds
from anatomist.estimate.time.ops import _passes_ops, step_ops
from anatomist.estimate.time.tiles import busy_fraction, tile_efficiency
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.store.parts import trace_part
from anatomist.workload_loader import load_workload
from tests.conftest import write_config

V100_SMS = 80


def test_bert_larges_products_fill_fewer_waves_at_one_sample():
    """bert-large's attention projections at 512 tokens, (tokens x 1024) @ (1024 x 1024), on a V100's 80 SMs. On CUDA
    cores (fp32) one sample makes 128 tiles of 64 x 64 (two waves, 0.8 of them busy), four samples 512 (seven waves,
    0.914). On tensor cores a 64 x 64 tile reaches half of a 128 x 128 one's rate: one sample runs best as 64 tiles of
    128 x 64 (one wave, 0.8 busy, at 2/3 of the rate), four samples as 64 tiles of 256 x 128 (0.8)."""
    assert busy_fraction((1, 512, 1024, 1024), V100_SMS, tensor_cores=False) == pytest.approx(0.8)
    assert busy_fraction((1, 2048, 1024, 1024), V100_SMS, tensor_cores=False) == pytest.approx(512 / 560)
    assert busy_fraction((1, 512, 1024, 1024), V100_SMS) == pytest.approx(0.8 * 2 / 3)
    assert busy_fraction((1, 2048, 1024, 1024), V100_SMS) == pytest.approx(0.8)
    # The feed-forward's (tokens x 1024) @ (1024 x 4096) fills more waves at one sample already.
    assert busy_fraction((1, 512, 4096, 1024), V100_SMS, tensor_cores=False) == pytest.approx(512 / 560)
    assert busy_fraction((1, 512, 4096, 1024), V100_SMS) == pytest.approx(0.8)


def test_a_tiles_reuse_sets_its_share_of_the_tensor_cores():
    assert tile_efficiency(256, 128) == tile_efficiency(128, 128) == 1.0
    assert tile_efficiency(128, 64) == pytest.approx(2 / 3)
    assert tile_efficiency(64, 64) == 0.5


def test_a_product_that_fills_its_waves_keeps_the_gpu_busy():
    assert busy_fraction((1, 80 * 128, 128, 64), V100_SMS) == 1.0
    assert busy_fraction((2, 108 * 256, 128, 64), 108) == 1.0
    assert busy_fraction((0, 0, 0, 0), V100_SMS) == 1.0  # not a product
    assert busy_fraction((1, 512, 1024, 1024), 0) == 1.0  # no SM count to tile by


def test_a_partial_tile_and_an_idle_wave_cost_time():
    """A product one row past a tile's edge runs another tile row; one tile past a wave runs another wave."""
    assert busy_fraction((1, 80 * 64 + 1, 64, 64), V100_SMS, tensor_cores=False) < 0.51
    assert busy_fraction((1, 64, 64, 4096), V100_SMS, tensor_cores=False) == pytest.approx(1 / 80)


def test_attention_tiles_query_rows_over_batch_and_heads():
    """A fused attention kernel's blocks take 128 (or 64) query rows against every key: 16 heads x 512 tokens make
    64 blocks of 128 rows, or 128 of 64 (two waves): 0.8 of 80 SMs either way."""
    assert busy_fraction((16, 512, 512, 64), V100_SMS, attention=True) == pytest.approx(0.8)
    assert busy_fraction((80, 128, 4096, 64), V100_SMS, attention=True) == 1.0


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_workload(str(write_config(tmp_path_factory.mktemp("models"), "llama")), seq_len=64)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_every_traced_product_has_the_shape_of_its_flops(llama, attention):
    """The shape the tracer records is the one PyTorch's flop_counter counted: 2 x batch x m x n x k for a product,
    twice that for attention's forward (Q K^T, then the probabilities times V)."""
    recipe = Recipe(per_device_train_batch_size=2, attn_implementation=attention).resolved(llama)
    products = [r for r in step_ops(llama, recipe).records if r.flops and r.name in ("mm", "addmm", "bmm", "baddbmm")]
    assert products
    for r in products:
        b, m, n, k = r.gemm
        assert r.flops == 2 * b * m * n * k, r
    attention_ops = [r for r in step_ops(llama, recipe).records if r.name.startswith("_scaled_dot_product")]
    assert bool(attention_ops) == (attention == "sdpa")
    for r in attention_ops:
        b, m, n, k = r.gemm
        assert b * m * n * k > 0
        if not r.name.endswith("_backward"):
            assert r.flops == 4 * b * m * n * k, r


def test_shapes_at_an_untraced_batch_are_the_traced_ones(llama):
    """Passes at batch 5 are extrapolated from the traces at 2 and 3: every product's shape is what a trace at 5
    records (a product's rows, sum or batch grow with the samples)."""
    recipe = Recipe(per_device_train_batch_size=5).resolved(llama)
    extrapolated = _passes_ops(llama, recipe, None, 5, "8.0")
    traced = trace_part(llama, recipe, "forward-backward", depth=None, batch_size=5, compute_capability="8.0").ops
    assert [s.gemm for s in extrapolated] == [s.gemm for s in traced]
    assert any(s.gemm[1] == 5 * 64 for s in traced)


def test_one_sample_runs_a_v100s_products_slower_per_sample(llama):
    """The products' fp32 seconds per sample at one sample and at four, on a V100 and on a GPU of one SM: where a
    sample's tiles do not fill the V100's waves, one sample is slower per sample; one SM runs every tile in a wave of
    its own, so a sample costs the same at any batch."""
    big = get_gpu("V100-16GB")
    small = dataclasses.replace(big, sm_count=1)
    per_sample = {}
    for gpu in (big, small):
        for batch in (1, 4):
            recipe = Recipe(per_device_train_batch_size=batch).resolved(llama)
            seconds = sum(peak_seconds(r, recipe, gpu)[1] * r.count for r in step_ops(llama, recipe, gpu.compute_capability).records
                          if r.flops)
            per_sample[gpu.sm_count, batch] = seconds / batch
    assert per_sample[80, 1] > 1.5 * per_sample[80, 4]
    assert per_sample[1, 1] == pytest.approx(per_sample[1, 4], rel=1e-9)
