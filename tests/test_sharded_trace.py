"""FSDP2 traced per rank (trace/step/fsdp.py): extrapolation, trace keys, offload, what is refused.

The accuracy against PyTorch's own accounting is test_fsdp_accuracy.py; here the cut-and-extrapolated
sharded estimate is checked against a trace of the full model at the wanted batch (the same tracer on
both sides: this checks the extrapolation in depth and batch, as test_extrapolation.py does for one
device).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from anatomist.anatomy import STEP_PHASES, TENSOR_CATEGORIES, MemoryCategory
from anatomist.estimate.memory import estimate_memory
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.step.driver import trace_step
from anatomist.trace.store.keys import part_key
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")
BATCH = 5  # outside the traced batch sizes (2, 3): extrapolated


def _full_depth_peak(workload, recipe, num_gpus):
    """The highest point of a full-depth sharded train step at BATCH, and its categories."""
    traced = trace_step(workload, recipe, depth=None, batch_size=BATCH, compute_capability=GPU.compute_capability,
                        part="train-step", num_gpus=num_gpus)
    curves = traced.curves
    in_step = np.array([key[0] in STEP_PHASES for key in curves.keys])
    i = int(np.argmax(np.where(in_step, curves.allocated, -1)))
    return curves.keys[i][0], curves.allocated[i], dict(zip(TENSOR_CATEGORIES, curves.categories[i], strict=True))


@pytest.mark.parametrize("model,recipe,num_gpus", [
    ("llama", Recipe(per_device_train_batch_size=BATCH, dtype="float32", fsdp="full_shard"), 4),
    ("gpt2", Recipe(per_device_train_batch_size=BATCH, dtype="float32", fsdp="shard_grad_op", bf16=True,
                    gradient_accumulation_steps=2, gradient_checkpointing=True), 2),
])
@pytest.mark.slow
def test_sharded_extrapolation_matches_a_full_depth_sharded_trace(tiny_model, model, recipe, num_gpus):
    workload = load_workload(str(tiny_model(model, num_hidden_layers=5, n_layer=5)), seq_len=64)
    resolved = recipe.resolved(workload)
    predicted = estimate_memory(workload, resolved, GPU, num_gpus=num_gpus).anatomy
    phase, allocated, categories = _full_depth_peak(workload, resolved, num_gpus)
    assert predicted.peak_phase == phase
    assert predicted.peak_allocated == pytest.approx(allocated, rel=0.005)
    for category in TENSOR_CATEGORIES:
        assert abs(predicted.category_bytes(category) - categories[category]) <= 0.005 * allocated, category


def test_the_world_size_keys_fsdp_traces_only(tiny_model):
    workload = load_workload(str(tiny_model("llama")), seq_len=32)
    fsdp = Recipe(fsdp="full_shard").resolved(workload)
    zero = Recipe(zero_stage=3).resolved(workload)

    def key(recipe, n):
        return part_key(workload, recipe, "forward-backward", 2, 2, "8.0", n)

    assert key(fsdp, 2) != key(fsdp, 8)
    assert key(zero, 2) == key(zero, 8) == key(zero.replace(zero_stage=0), 1)  # ZeRO is arithmetic on one device
    assert key(fsdp, 8) != key(fsdp.replace(offload="cpu"), 8)


def test_a_trace_is_the_same_first_and_again(tiny_model):
    """DTensor's shape propagation runs ops on fake tensors the first time it meets an op (then caches):
    not the step's memory, so a process's first trace is its later ones."""
    workload = load_workload(str(tiny_model("llama", num_hidden_layers=2)), seq_len=32)
    recipe = Recipe(fsdp="full_shard", optim="adamw_torch", dtype="float32").resolved(workload)
    first, again = (trace_step(workload, recipe, depth=None, batch_size=2, compute_capability="8.0", part="optimizer",
                               num_gpus=4) for _ in range(2))
    assert first.op_count == again.op_count
    assert np.array_equal(first.curves.allocated, again.curves.allocated)


def test_both_strategies_share_the_optimizer_step(tiny_model):
    """full_shard and shard_grad_op differ only in whether a unit reshards after its forward: their optimizer steps
    share one key, and each traced on its own gives the same trace, byte for byte."""
    import pickle

    workload = load_workload(str(tiny_model("llama", num_hidden_layers=2)), seq_len=32)
    full = Recipe(fsdp="full_shard", optim="adamw_torch", dtype="float32").resolved(workload)
    grads_only = full.replace(fsdp="shard_grad_op")
    def key(recipe, part):
        return part_key(workload, recipe, part, 2, 2, "8.0", 2)

    assert key(full, "optimizer") == key(grads_only, "optimizer")
    assert key(full, "forward-backward") != key(grads_only, "forward-backward")
    traced = [trace_step(workload, r, depth=2, batch_size=1, compute_capability="8.0", part="optimizer", num_gpus=2,
                         record_ops=True) for r in (full, grads_only)]
    assert pickle.dumps(traced[0]) == pickle.dumps(traced[1])


@pytest.mark.slow
def test_cpu_offload_keeps_the_sharded_state_on_the_host(tiny_model):
    workload = load_workload(str(tiny_model("llama", num_hidden_layers=3)), seq_len=64)
    kept = estimate_memory(workload, Recipe(per_device_train_batch_size=3, fsdp="full_shard").resolved(workload), GPU,
                           num_gpus=4).anatomy
    offloaded = estimate_memory(workload, Recipe(per_device_train_batch_size=3, fsdp="full_shard", offload="cpu")
                                .resolved(workload), GPU, num_gpus=4).anatomy
    assert kept.optimizer_states > 0 and offloaded.optimizer_states == 0
    assert offloaded.peak_allocated < kept.peak_allocated - kept.optimizer_states


def test_fsdp_without_repeated_blocks_is_refused(cli, tmp_path):
    albert = {"model_type": "albert", "architectures": ["AlbertForMaskedLM"], "hidden_size": 64, "embedding_size": 32,
              "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000,
              "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(albert))
    result = cli("estimate", str(tmp_path), "--fsdp", "full_shard", "--gpus", "2", "--seq-len", "32")
    assert result.returncode == 2
    assert "no repeated block" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_each_rank_holds_its_padded_shard_of_every_parameter(tiny_model):
    """FSDP2 shards each parameter on dim 0 into world-size chunks padded to ceil(rows / world) rows; a
    rank's weights between steps are its chunks (and the rotary buffer, unsharded)."""
    import math

    import torch

    workload = load_workload(str(tiny_model("llama", num_hidden_layers=2, hidden_size=72, intermediate_size=90)),
                             seq_len=32)
    recipe = Recipe(fsdp="full_shard", dtype="float32").resolved(workload)
    with torch.device("meta"):
        model = workload.build_model("sdpa", "float32")
    world = 8
    expected = sum(math.ceil(math.ceil(p.shape[0] / world) * p[0].numel() * 4 / 512) * 512
                   for p in model.parameters())
    expected += sum(math.ceil(b.numel() * b.element_size() / 512) * 512 for b in model.buffers())
    traced = trace_step(workload, recipe, depth=None, batch_size=2, compute_capability="8.0", part="optimizer",
                        num_gpus=world)
    peak = traced.peaks()[STEP_PHASES[2], "pre"]  # the optimizer step: the unsharded parameters are freed
    assert peak.categories[MemoryCategory.WEIGHTS] == expected


@pytest.mark.slow
def test_half_weights_under_fsdp_mixed_precision_are_upcast_as_accelerate_does(tiny_model):
    """accelerate's fsdp2_prepare_model upcasts trainable parameters to fp32 when mixed precision is on,
    whatever dtype they were loaded in: the optimizer state is fp32 (AdamW: 8 B per parameter of the shard),
    and the notes say so instead of "pure bfloat16 training"."""
    workload = load_workload(str(tiny_model("llama", num_hidden_layers=2)), seq_len=32)
    recipe = Recipe(fsdp="full_shard", dtype="bfloat16", bf16=True, optim="adamw_torch").resolved(workload)
    memory = estimate_memory(workload, recipe, GPU, num_gpus=2)
    assert any("FSDP2 upcasts the trainable parameters to fp32" in note for note in memory.notes)
    assert not any("pure bfloat16 training" in note for note in memory.notes)
    states = memory.anatomy.category_bytes(MemoryCategory.OPTIMIZER_STATES)
    assert states == pytest.approx(8 * memory.parameters / 2, rel=0.05)
