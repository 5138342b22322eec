"""FLOPs of one training step, counted on fake tensors, against hand arithmetic."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from torch.utils.flop_counter import FlopCounterMode

from anatomist.anatomy import Phase, StepFlops
from anatomist.estimate.time.ops import OpRecord, _record, _step_at_depth, passes_ops, step_flops, step_ops
from anatomist.recipe import Recipe
from anatomist.trace.engine.op_costs import CUSTOM_FLOPS
from anatomist.trace.step.driver import trace_step
from anatomist.trace.store.parts import trace_part
from anatomist.workload import Workload
from anatomist.workload_loader import load_workload

CC = "8.0"

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# hidden 32, 2 layers, 2 heads (head_dim 16), intermediate 64, seq 16, batch 2: 32 tokens.
TINY_BERT = {
    "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 64, "type_vocab_size": 2,
}


def tiny_bert(tmp_path: Path, **overrides: object) -> Workload:
    (tmp_path / "config.json").write_text(json.dumps({**TINY_BERT, **overrides}))
    return load_workload(str(tmp_path), seq_len=16, task="sequence-classification")


# Forward matrix products of the tiny BERT (2 FLOPs per multiply-add, tokens = 2 x 16 = 32):
#   per layer: Q, K, V, O linears    4 x 2*32*32*32      = 262,144
#              up and down linears   2 x 2*32*32*64      = 262,144
#              attention QK^T and PV 2 x 2*2*2*16*16*16  =  65,536   (2*b*heads*s*s*head_dim each)
#              layer total                               = 589,824
#   2 layers                                             = 1,179,648
#   pooler (2 samples x 32 -> 32)    2*2*32*32           =     4,096
#   classifier (32 -> 2 labels)      2*2*32*2            =       256
#   forward                                              = 1,184,000
# Backward: every linear and both attention products do 2 products (grad input, grad
# weight / the two operands): 2 x forward = 2,368,000. Step: 3,552,000.
FORWARD = 2 * (4 * 2 * 32 * 32 * 32 + 2 * 2 * 32 * 32 * 64 + 2 * 2 * 2 * 2 * 16 * 16 * 16) + 2 * 2 * 32 * 32 + 2 * 2 * 32 * 2
BLOCKS_FORWARD = 2 * 589_824


def test_hand_formula_eager(tmp_path: Path) -> None:
    w = tiny_bert(tmp_path)
    recipe = Recipe(per_device_train_batch_size=2, attn_implementation="eager")
    ops = step_ops(w, recipe.resolved(w))
    assert FORWARD == 1_184_000
    assert ops.flops(Phase.FORWARD) == FORWARD
    assert ops.flops(Phase.BACKWARD) == 2 * FORWARD
    assert ops.flops(Phase.OPTIMIZER) == 0
    assert step_flops(w, recipe.resolved(w)) == StepFlops(model=3 * FORWARD, hardware=3 * FORWARD)
    assert 3 * FORWARD == 3_552_000
    # Our per-op records add up to PyTorch's own FlopCounterMode total over the same passes.
    assert _counter_flops(w, recipe) == ops.flops(Phase.FORWARD) + ops.flops(Phase.BACKWARD)


def test_accumulation_multiplies_micro_batches(tmp_path: Path) -> None:
    w = tiny_bert(tmp_path)
    recipe = Recipe(per_device_train_batch_size=2, attn_implementation="eager", gradient_accumulation_steps=3)
    assert step_flops(w, recipe.resolved(w)).model == 3 * 3 * FORWARD


def test_checkpointing_adds_one_forward_of_the_blocks_to_hardware_flops_only(tmp_path: Path) -> None:
    w = tiny_bert(tmp_path)
    plain = step_flops(w, Recipe(per_device_train_batch_size=2, attn_implementation="eager").resolved(w))
    ckpt = step_flops(w, Recipe(per_device_train_batch_size=2, attn_implementation="eager", gradient_checkpointing=True).resolved(w))
    # Model FLOPs (MFU) leave the recomputation out: the same step as without checkpointing.
    assert ckpt.model == plain.model == plain.hardware == 3 * FORWARD
    # Recompute runs each block's forward again in backward (not the pooler or classifier).
    assert ckpt.hardware - ckpt.model == BLOCKS_FORWARD == 1_179_648


@pytest.mark.parametrize("recipe", [
    # sdpa, 5 layers (extrapolated in depth from 2 and 3), batch 8 (extrapolated from 2 and 3), accumulation 3
    Recipe(per_device_train_batch_size=8, gradient_accumulation_steps=3),
    # bf16 autocast: the recomputed forward casts the weights again
    Recipe(per_device_train_batch_size=2, bf16=True),
], ids=["sdpa-extrapolated", "bf16"])
@pytest.mark.slow
def test_hardware_flops_add_one_forward_of_the_blocks_per_micro_batch(tmp_path: Path, recipe: Recipe) -> None:
    w = tiny_bert(tmp_path, num_hidden_layers=5)
    plain = step_flops(w, recipe.resolved(w))
    ckpt = step_flops(w, replace(recipe, gradient_checkpointing=True).resolved(w))
    assert ckpt.model == plain.model == plain.hardware
    # 589,824 per block at 2 samples (the hand count above), linear in the batch
    blocks = 5 * 589_824 * recipe.per_device_train_batch_size // 2 * recipe.gradient_accumulation_steps
    assert ckpt.hardware - ckpt.model == blocks


@pytest.mark.slow
def test_model_flops_with_peft_are_the_step_without_checkpointing(tiny_model) -> None:
    """With LoRA, checkpointing changes more than the recomputed forward: transformers makes the
    frozen embeddings' output require a gradient, so backward also computes the first block's
    input gradient. Model FLOPs leave that out with the recomputation."""
    w = load_workload(str(tiny_model("llama")), seq_len=32)
    lora = Recipe(per_device_train_batch_size=2, peft="lora")
    plain, ckpt = step_flops(w, lora.resolved(w)), step_flops(w, replace(lora, gradient_checkpointing=True).resolved(w))
    assert ckpt.model == plain.model == plain.hardware
    assert ckpt.hardware > ckpt.model


def test_sdpa_counts_attention_through_the_cuda_formula(tmp_path: Path) -> None:
    w = tiny_bert(tmp_path)
    ops = step_ops(w, Recipe(per_device_train_batch_size=2, attn_implementation="sdpa").resolved(w))
    assert ops.flops(Phase.FORWARD) == FORWARD
    assert _counter_flops(w, Recipe(per_device_train_batch_size=2)) == ops.flops(Phase.FORWARD) + ops.flops(Phase.BACKWARD)
    assert any(r.name.startswith("_scaled_dot_product") and r.flops > 0 for r in ops.records)
    assert ops.unknown_ops() == []



def _counter_flops(w: Workload, recipe: Recipe) -> int:
    """PyTorch's FlopCounterMode over one micro-batch's passes of the full model, traced directly."""
    counter = FlopCounterMode(display=False, custom_mapping=CUSTOM_FLOPS)
    trace_step(w, recipe.resolved(w), depth=None, batch_size=recipe.per_device_train_batch_size, compute_capability=CC,
               observers=(counter,))
    return counter.get_total_flops()


def test_depth_extrapolation_is_exact(tmp_path: Path) -> None:
    """Traced at 2 and 3 layers and extrapolated to 5 = traced at 5 directly."""
    w = tiny_bert(tmp_path, num_hidden_layers=5)
    recipe = Recipe(per_device_train_batch_size=2).resolved(w)
    extrapolated = step_ops(w, recipe, CC)
    direct = [_record(sig, float(n)) for sig, n in _step_at_depth(w, recipe, 5, CC).items()]
    _assert_same_costs(extrapolated.records, direct)
    assert extrapolated.flops(Phase.FORWARD) + extrapolated.flops(Phase.BACKWARD) == _counter_flops(w, recipe)


def test_batch_extrapolation_is_exact(tmp_path: Path) -> None:
    """Passes at batch 8 extrapolated from the traces at 2 and 3 = traced at 8 directly."""
    w = tiny_bert(tmp_path)
    for recipe in (Recipe(per_device_train_batch_size=8), Recipe(per_device_train_batch_size=8, bf16=True,
                                                                   gradient_checkpointing=True)):
        extrapolated = passes_ops(w, recipe.resolved(w), 2, CC)
        direct = trace_part(w, recipe.resolved(w), "forward-backward", depth=2, batch_size=8, compute_capability=CC).ops
        assert extrapolated == direct


def _assert_same_costs(a: list[OpRecord], b: list[OpRecord]) -> None:
    for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER):
        assert sum(r.flops * r.count for r in a if r.phase is phase) == sum(r.flops * r.count for r in b if r.phase is phase)
        assert sum(r.bytes * r.count for r in a if r.phase is phase) == pytest.approx(
            sum(r.bytes * r.count for r in b if r.phase is phase), rel=1e-6)


def test_mixture_of_experts_grouped_products(tmp_path: Path) -> None:
    """transformers 5 runs a Mixtral layer's experts as two grouped products over the routed
    rows: 2 x 16 tokens x top-2 = 64 rows; gate+up 64 -> 256, down 128 -> 64."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "vocab_size": 100, "max_position_embeddings": 64, "dtype": "bfloat16",
    }))
    ops = step_ops(load_workload(str(tmp_path), seq_len=16), Recipe(per_device_train_batch_size=2).resolved(load_workload(str(tmp_path), seq_len=16)))
    grouped = {(r.phase, r.flops): r.count for r in ops.records if r.name == "_grouped_mm"}
    gate_up, down = 2 * 64 * 64 * 256, 2 * 64 * 128 * 64
    # forward: once per layer; backward: the input's and the weights' gradients, same FLOPs each
    assert grouped == {(Phase.FORWARD, gate_up): 2, (Phase.FORWARD, down): 2,
                       (Phase.BACKWARD, gate_up): 4, (Phase.BACKWARD, down): 4}
    assert all(r.op_class.value == "contraction" for r in ops.records if r.name == "_grouped_mm")
