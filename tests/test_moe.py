"""Mixture of Experts, honestly: the routing the estimate assumes is stated, the worst case a real router
can reach is shown to keep the same tensors (a real step with every token sent to the same experts), and
the experts kernels a trace cannot follow are refused with one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from anatomist.errors import InputError
from anatomist.estimate.predict import estimate
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.step.driver import trace_step
from anatomist.workload_loader import load_workload

GPU = get_gpu("H100-80GB")
SEQ = 64
QWEN3_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 500, "max_position_embeddings": 256,
    "dtype": "bfloat16",
}


def _moe(tmp_path: Path, **overrides: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_MOE, **overrides}))
    return tmp_path


@pytest.mark.parametrize(("kernel", "same"), [("grouped_mm", True), ("batched_mm", True), ("eager", False)])
def test_real_step_keeps_the_same_tensors_for_any_routing(tmp_path, monkeypatch, kernel, same):
    """A real CPU training step whose router sends every token to experts 0 and 1 (expert 0 receives all
    4 x 64 = 256 tokens) allocates exactly the storages, in the same order, of one whose router spreads the
    512 routed rows evenly (64 per expert), under grouped_mm and batched_mm. Under eager, whose loop takes
    each expert's tokens by value, they differ: why the estimate refuses it."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    workload = load_workload(str(_moe(tmp_path)), seq_len=SEQ)
    tokens, top_k, experts = 4 * SEQ, 2, 8
    choices = {
        "balanced": (torch.arange(tokens * top_k) % experts).view(tokens, top_k),
        "one expert takes every token": torch.arange(top_k).repeat(tokens, 1),
    }
    routed = modeling_qwen3_moe.Qwen3MoeTopKRouter.forward
    curves = {}
    for name, chosen in choices.items():
        def forward(self, hidden, chosen=chosen):
            logits, weights, _ = routed(self, hidden)
            return logits, weights, chosen

        monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", forward)
        recipe = Recipe(per_device_train_batch_size=4, experts_implementation=kernel)
        trace = trace_step(workload, recipe.resolved(workload), depth=None, batch_size=4, compute_capability=GPU.compute_capability,
                           part="train-step", fake=False)
        curves[name] = trace.curves.allocated
    assert np.array_equal(*curves.values()) is same


def test_estimate_states_the_balanced_routing_and_its_range(tmp_path):
    """2 x 64 = 128 tokens, top-2 of 8 experts: 256 routed rows, 256 / 8 = 32 tokens per expert."""
    result = estimate(load_workload(str(_moe(tmp_path)), seq_len=SEQ), Recipe(per_device_train_batch_size=2), GPU)
    notes = [n for n in result.memory.notes if n.startswith("Mixture of Experts")]
    assert len(notes) == 1
    assert "(128 tokens x top-2 / 8 experts = 32 tokens per expert and layer)" in notes[0]
    assert "grouped_mm runs all 256 routed rows" in notes[0]
    assert not [n for n in result.memory.notes if "real choice" in n]
    moe = result.to_dict()["moe"]
    peak = result.memory.anatomy.peak_allocated
    assert moe == {"experts_implementation": "grouped_mm", "experts": 8, "experts_per_token": 2, "tokens": 128,
                   "routed_rows": 256, "balanced_tokens_per_expert": 32.0, "max_tokens_per_expert": 128,
                   "peak_range_bytes": [peak, peak], "ep_size": 1}


@pytest.mark.slow
def test_batched_mm_is_modelled_with_its_weight_copies(tmp_path):
    """batched_mm gathers every routed row's expert weights: [256 rows, 64, 64] + [256, 64, 32] bf16 per layer,
    kept for backward: it needs more than grouped_mm, which reads the weights in place."""
    workload = load_workload(str(_moe(tmp_path)), seq_len=SEQ)
    peaks = {kernel: estimate(workload, Recipe(per_device_train_batch_size=2, experts_implementation=kernel), GPU)
             for kernel in ("grouped_mm", "batched_mm")}
    gathered = 256 * 64 * 64 * 2 + 256 * 64 * 32 * 2  # bytes of one layer's gathered gate_up and down weights
    grown = peaks["batched_mm"].memory.anatomy.peak_allocated - peaks["grouped_mm"].memory.anatomy.peak_allocated
    assert grown >= gathered
    assert peaks["batched_mm"].moe is not None and peaks["batched_mm"].moe.experts_implementation == "batched_mm"


def test_dense_model_has_no_routing_and_ignores_the_experts_kernel(tiny_model):
    workload = load_workload(str(tiny_model("llama")), seq_len=SEQ)
    result = estimate(workload, Recipe(per_device_train_batch_size=2, experts_implementation="eager"), GPU)
    assert result.moe is None and "moe" not in result.to_dict()
    assert not [n for n in result.memory.notes if "Mixture of Experts" in n]


def test_eager_experts_are_refused_with_one_line(cli, tmp_path):
    result = cli("estimate", str(_moe(tmp_path)), "--seq-len", str(SEQ), "--gpu", "H100-80GB",
                 "--experts-implementation", "eager")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "experts_implementation='eager' loops over the experts the router picked" in lines[0]
    assert "modelled: grouped_mm, batched_mm" in lines[0]


def test_config_naming_another_experts_kernel_is_refused(cli, tmp_path):
    result = cli("estimate", str(_moe(tmp_path, experts_implementation="eager")), "--seq-len", str(SEQ),
                 "--gpu", "H100-80GB")
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "its config sets experts_implementation='eager' but the recipe models 'grouped_mm'" in result.stderr


def test_unknown_experts_kernel_is_refused(cli):
    result = cli("estimate", "Mixtral-8x7B-v0.1", "--experts-implementation", "sonicmoe")
    assert result.returncode == 2
    assert "argument --experts-implementation: invalid choice: 'sonicmoe'" in result.stderr
    with pytest.raises(InputError, match="unknown experts_implementation 'deepgemm'"):
        Recipe(experts_implementation="deepgemm")  # type: ignore[arg-type]


def test_trl_model_init_kwargs_name_the_experts_kernel(tmp_path):
    """SFTConfig.model_init_kwargs go to from_pretrained, experts_implementation with them."""
    from anatomist.recipe.files import read_recipe_file

    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen3-30B-A3B\nmax_length: 512\n"
                    "model_init_kwargs:\n  experts_implementation: batched_mm\n")
    assert read_recipe_file(path).recipe.experts_implementation == "batched_mm"
