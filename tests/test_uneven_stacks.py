"""Models whose blocks are not all alike: the estimate against a trace of the full-depth model.

The estimator traces a model cut to a few blocks and extrapolates (`estimate/traces.py`). For each
kind of uneven stack of issue 12 a small config: T5 with encoder and decoder of different depths,
DeepSeek-V3's dense-then-MoE layers (its multi-head latent attention also runs values narrower
than keys through SDPA), Qwen3-MoE's MoE layers every other layer, Gemma 3's sliding and global
attention, LFM2's hybrid of convolution and attention layers, ALBERT's shared layers. For each,
the predicted peak and every memory category must be within 1% of the same tracer run on the
full-depth model (the whole steady-state step in one go, as the Trainer runs it, at the batch
size predicted), and the parameter count exactly the model's: built on the meta device and, the
independent truth, built for real on the CPU.
"""

from __future__ import annotations

import json
import pickle
import zlib
from collections import Counter
from pathlib import Path

import pytest

from anatomist.anatomy import TENSOR_CATEGORIES
from anatomist.estimate.predict import estimate
from anatomist.estimate.traces import implied_parameters, step_traces
from anatomist.hardware import get_gpu
from anatomist.model_catalog import catalog_entries
from anatomist.model_config import config_from_dict
from anatomist.model_facts import facts_of
from anatomist.recipe import Recipe
from anatomist.trace.depth import plan as cuts_module
from anatomist.trace.step.driver import trace_step
from anatomist.trace.store import cache
from anatomist.workload import Workload
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")
BATCH = 3  # one of the traced batch sizes: what is compared is the extrapolation in depth
SEQ = 16

_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 256, "max_position_embeddings": 256}
CASES: dict[str, tuple[str, dict, str]] = {
    # 16 encoder and 4 decoder layers: the decoder must not be counted as deep as the encoder.
    "t5-uneven-depths": ("seq2seq-lm", {
        "model_type": "t5", "d_model": 64, "d_ff": 128, "d_kv": 16, "num_heads": 4, "num_layers": 16,
        "num_decoder_layers": 4, "vocab_size": 256, "feed_forward_proj": "gated-gelu", "decoder_start_token_id": 0,
        "pad_token_id": 0, "eos_token_id": 1}, "by-kind"),
    # first_k_dense_replace=2: 2 dense layers, then 12 MoE layers; values (16) narrower than q/k (8 + 16).
    "deepseek-v3-first-k-dense": ("causal-lm", {
        "model_type": "deepseek_v3", "num_hidden_layers": 14, **_SIZES, "num_key_value_heads": 4,
        "first_k_dense_replace": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "dtype": "bfloat16"}, "by-kind"),
    # decoder_sparse_step=2: layers 1, 3, 5, ... are MoE, the others dense.
    "qwen3-moe-interleaved": ("causal-lm", {
        "model_type": "qwen3_moe", "num_hidden_layers": 14, **_SIZES, "head_dim": 16, "decoder_sparse_step": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "dtype": "bfloat16"}, "by-kind"),
    # every other layer global, the others a sliding window of 8 tokens (shorter than the sequence).
    "gemma3-sliding-global": ("causal-lm", {
        "model_type": "gemma3_text", "num_hidden_layers": 14, **_SIZES, "head_dim": 16, "sliding_window": 8,
        "sliding_window_pattern": 2}, "by-kind"),
    # convolution layers with attention layers at 2, 5, 8, 11, 14.
    "lfm2-hybrid": ("causal-lm", {
        "model_type": "lfm2", "num_hidden_layers": 16, **_SIZES, "full_attn_idxs": [2, 5, 8, 11, 14]}, "by-kind"),
    # 6 layers sharing 2 groups of weights: no cut keeps what the full model shares.
    "albert-shared-layers": ("sequence-classification", {
        "model_type": "albert", "num_hidden_layers": 6, "num_hidden_groups": 2, "embedding_size": 32,
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 256,
        "max_position_embeddings": 256}, "full"),
}


def _workload(name: str, **changed: object) -> Workload:
    """The case's workload; `changed` fields make a model of its own (no plan or trace of another test reused)."""
    task, data, _ = CASES[name]
    data = {**data, **changed}
    config = config_from_dict(dict(data), name, False)
    return Workload(name=name, config_json=data, facts=facts_of(config), built_config=config, task=task, seq_len=SEQ)


def _recipe(workload: Workload) -> Recipe:
    return Recipe(per_device_train_batch_size=BATCH, dtype="bfloat16" if workload.is_moe else "auto")


def _real_parameters(workload: Workload, recipe: Recipe) -> int:
    """Parameters of the model built for real on the CPU (shared weights once, as Module.parameters gives them)."""

    return sum(p.numel() for p in workload.build_model("sdpa", recipe.dtype).parameters())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_uneven_stack_matches_a_full_depth_trace(name):
    workload, how = _workload(name), CASES[name][2]
    recipe = _recipe(workload)
    result = estimate(workload, recipe, GPU)
    traces = step_traces(workload, recipe.resolved(workload), GPU.compute_capability)
    assert traces.plan.how == how
    assert traces.plan.note in result.memory.notes  # how it was traced is said

    real = _real_parameters(workload, recipe)
    assert result.memory.parameters == traces.parameters == real  # the meta-device count, and the real one
    assert implied_parameters(traces) == (real, real)  # what the traced cuts add up to

    full = trace_step(workload, recipe.resolved(workload), depth=None, batch_size=BATCH, compute_capability=GPU.compute_capability,
                      part="train-step", record_ops=True)
    peaks = full.peaks()
    phase, _segment = max(peaks, key=lambda k: peaks[k].allocated)
    measured = peaks[phase, _segment]
    predicted = result.memory.anatomy
    assert predicted.peak_phase == phase
    assert predicted.peak_allocated == pytest.approx(measured.allocated, rel=0.01)
    for category in TENSOR_CATEGORIES:
        assert predicted.category_bytes(category) == pytest.approx(measured.categories[category], rel=0.01), category
    flops = sum(op[4] for op in full.ops)  # one micro-batch and the optimizer step, as predicted
    assert result.time.flops_per_step == pytest.approx(flops, rel=0.01)


@pytest.mark.slow
def test_a_plan_whose_count_is_wrong_falls_back_to_full_depth(monkeypatch):
    # Cutting both of T5's stacks to 2 and 3 layers (what a uniform model gets) implies a decoder as
    # deep as the encoder: 16 + 16 layers instead of 16 + 4. The check must catch it and trace the full model.
    workload = _workload("t5-uneven-depths", d_ff=96)
    recipe = _recipe(workload)
    uniform = cuts_module.TracePlan(base=2, deltas=(cuts_module.Delta(cut=3, multiplier=14, inserted=(1, 4)),),
                                    how="uniform")
    monkeypatch.setattr(cuts_module, "trace_plan", lambda *_: uniform)
    traces = step_traces(workload, recipe.resolved(workload), GPU.compute_capability, "inference")
    assert traces.plan.how == "full"
    assert "imply" in traces.plan.note and f"{traces.parameters:,}" in traces.plan.note
    assert implied_parameters(traces)[0] == traces.parameters == _real_parameters(workload, recipe)


def test_uniform_models_take_the_two_and_three_block_traces_only(tiny_model, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ANATOMIST_CACHE_DIR", str(tmp_path / "cache"))
    cache.clear_memory()
    cache.set_disk_cache(True)
    try:
        workload = load_workload(str(tiny_model("llama", num_hidden_layers=6)), seq_len=SEQ)
        recipe = Recipe(per_device_train_batch_size=BATCH)
        result = estimate(workload, recipe, GPU)  # memory and time
        traces = step_traces(workload, recipe.resolved(workload), GPU.compute_capability)
        assert traces.plan.how == "uniform" and traces.plan.cuts == (2, 3)
        stored = Counter(type(pickle.loads(zlib.decompress(p.read_bytes()))).__name__
                         for p in cache.cache_dir().glob("*.trace"))
        # passes at 2 depths x 2 batches, optimizer at 2 depths; the plan with the exact parameter count;
        # what the estimate reads of the config (model_facts)
        assert stored == {"StepTrace": 6, "ModelPlan": 1, "ModelFacts": 1}
        assert result.memory.parameters == _real_parameters(workload, recipe)
        assert not any("depth" in note or "kind" in note for note in result.memory.notes)
    finally:
        cache.clear_memory()


def test_the_catalogs_t5_with_uneven_depths_reports_its_published_size(cli):
    entry = catalog_entries()["t5-efficient-small-el32"]
    out = cli("estimate", "t5-efficient-small-el32", "--mode", "inference", "--seq-len", "16", "--json")
    assert out.returncode == 0, out.stderr
    parameters = json.loads(out.stdout)["parameters"]
    # 142,322,176 built (32 encoder, 6 decoder layers); before, the decoder was extrapolated as deep
    # as the encoder (251M).
    assert abs(parameters - entry.parameters) <= entry.tolerance * entry.parameters
