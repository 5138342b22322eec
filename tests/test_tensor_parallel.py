"""Tensor parallel (`tp_size`): what a rank of it holds and runs, its collectives' time, and its bad input.

What a traced rank holds is checked against PyTorch's own accounting of a real step in test_fsdp_accuracy.py
(TP_CASES); here, what can be checked without a second process: the split model is transformers' (its weights are
DTensors sharded as the model's tp_plan says, counted by their local shards), the collectives the rank runs are the
ones the plan implies, the time adds them, and the inputs transformers would refuse are refused in one line.
"""

from __future__ import annotations

import pytest

from anatomist.estimate.predict import estimate
from anatomist.estimate.time.collectives import tensor_parallel_s
from anatomist.estimate.time.network import intra_node_bytes_per_s
from anatomist.estimate.time.ops import step_ops
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.engine.records import COLLECTIVE_PREFIX
from anatomist.trace.store.keys import part_key, traced_world
from anatomist.workload_loader import load_workload

GPU = get_gpu("H100")
SEQ, HIDDEN, BLOCKS, VOCAB = 64, 128, 2, 512


@pytest.fixture
def llama(tiny_model):
    path = tiny_model("llama", num_hidden_layers=BLOCKS, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    return path, load_workload(str(path), seq_len=SEQ)


@pytest.mark.slow  # 8 s on 2 cores (a one-device and a tensor parallel estimate): the default suite's time
def test_a_rank_holds_its_shards_of_the_split_layers(llama):
    """Two ranks hold half of each split weight (every linear layer of the blocks, the embeddings and the head) and all
    of the norms: the weights traced at the peak are those bytes, as transformers' tp_plan splits them."""
    _, workload = llama
    one = estimate(workload, Recipe(per_device_train_batch_size=2), GPU).memory.anatomy
    split = estimate(workload, Recipe(per_device_train_batch_size=2, tp_size=2), GPU, num_gpus=2).memory.anatomy
    norms = (2 * BLOCKS + 1) * HIDDEN * 4
    assert split.weights < 0.52 * one.weights
    assert split.weights == pytest.approx((one.weights - norms) / 2 + norms, rel=0.02)
    assert split.optimizer_states == pytest.approx(one.optimizer_states / 2, rel=0.03)


def test_the_collectives_are_the_plans(llama):
    """Per micro-batch, the all-reduces transformers' plan implies: forward, one after each rowwise layer (attention
    output, MLP down-projection) and one after the embeddings split by vocabulary; backward, one per colwise layer's
    input gradient (q, k, v, gate, up) and the head's. The time prices each at the node's bus bandwidth."""
    _, workload = llama
    recipe = Recipe(per_device_train_batch_size=2, tp_size=2).resolved(workload)
    ops = step_ops(workload, recipe, GPU.compute_capability)
    calls = {(r.phase.value, r.name.removeprefix(COLLECTIVE_PREFIX)): r.count for r in ops.records
             if r.name.startswith(COLLECTIVE_PREFIX) and r.phase.value != "optimizer"}
    assert calls[("forward", "all_reduce")] == 2 * BLOCKS + 1
    assert calls[("backward", "all_reduce")] == 5 * BLOCKS + 1
    assert calls[("forward", "all_gather_into_tensor")] == 1  # the head's logits, gathered (colwise_gather_output)
    activation = 2 * SEQ * HIDDEN * 4  # one micro-batch's hidden states in fp32
    logits = 2 * SEQ * VOCAB * 4
    moved = (7 * BLOCKS + 2) * activation + logits / 2  # an all-reduce moves half its tensor twice, an all-gather once
    seconds = tensor_parallel_s(ops, recipe, GPU)
    assert seconds == pytest.approx(moved / intra_node_bytes_per_s(GPU), rel=0.01)
    time = estimate(workload, Recipe(per_device_train_batch_size=2, tp_size=2), GPU, num_gpus=2).time
    assert time.phases_s["communication"] >= seconds
    assert time.samples_per_second == pytest.approx(2 / time.step_s)  # two GPUs, one batch


def test_the_trace_is_a_ranks_of_its_world(llama):
    _, workload = llama
    alone = Recipe(per_device_train_batch_size=2, tp_size=2).resolved(workload)
    sharded = Recipe(per_device_train_batch_size=2, tp_size=2, fsdp="full_shard").resolved(workload)
    assert (traced_world(alone, 2), traced_world(sharded, 8)) == (2, 8)
    plain = Recipe(per_device_train_batch_size=2).resolved(workload)
    assert part_key(workload, alone, "forward-backward", 2, 2, "9.0") != part_key(workload, plain, "forward-backward",
                                                                                   2, 2, "9.0")


@pytest.mark.slow
def test_tensor_parallel_under_fsdp_shards_the_shards(llama):
    """TP 2 x FSDP 2 on four GPUs: the optimizer states are a quarter of one device's."""
    _, workload = llama
    one = estimate(workload, Recipe(per_device_train_batch_size=2), GPU).memory.anatomy
    both = estimate(workload, Recipe(per_device_train_batch_size=2, tp_size=2, fsdp="full_shard"), GPU,
                    num_gpus=4).memory.anatomy
    assert both.optimizer_states == pytest.approx(one.optimizer_states / 4, rel=0.05)


@pytest.mark.parametrize(("flags", "message"), [
    (["--gpus", "3", "--tp-size", "2"], "tp_size=2 does not divide the 3 GPUs"),
    (["--gpus", "4", "--tp-size", "2"], "tp_size=2 on 4 GPUs is modelled with FSDP over the 2 groups"),
    (["--gpus", "8", "--tp-size", "8", "--fsdp", "full_shard"], "tp_size=8 does not divide its 4 attention heads"),
    (["--gpus", "4", "--tp-size", "4"], "tp_size=4 does not divide its 2 key/value heads"),
    (["--gpus", "2", "--tp-size", "2", "--peft", "lora"], "tp_size=2 with LoRA/QLoRA"),
    (["--gpus", "2", "--tp-size", "2", "--zero-stage", "2"], "tp_size=2 with DeepSpeed ZeRO"),
    (["--gpus", "2", "--tp-size", "0"], "tp_size must be at least 1, got 0"),
    (["--gpus", "4", "--tp-size", "2", "--fsdp", "shard_grad_op"], "tp_size=2 with fsdp=shard_grad_op"),
    (["--gpus", "2", "--tp-size", "2", "--optim", "adafactor"], "tp_size=2 with optim=adafactor is not modelled"),
    (["--gpus", "1", "--nodes", "2", "--tp-size", "2"], "tp_size=2 is more than a node's 1 GPU(s)"),
])
def test_bad_input_is_one_line(cli, llama, flags, message):
    path, _ = llama
    result = cli("estimate", str(path), "--seq-len", str(SEQ), "--gpu", "H100", *flags)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert message in result.stderr


def test_a_model_without_a_plan_is_refused(cli, tiny_model):
    bert = tiny_model("bert")
    result = cli("estimate", str(bert), "--seq-len", "32", "--gpu", "H100", "--gpus", "2", "--tp-size", "2")
    assert result.returncode == 2
    assert "no tensor parallel plan (base_model_tp_plan)" in result.stderr


def test_plan_says_it_does_not_search_tensor_parallel(cli, llama, tmp_path):
    path, _ = llama
    recipe = tmp_path / "args.yaml"
    recipe.write_text("per_device_train_batch_size: 1\nparallelism_config:\n  tp_size: 2\n")
    result = cli("plan", str(path), "--seq-len", str(SEQ), "--gpu", "H100", "--gpus", "2", "--recipe", str(recipe))
    assert result.returncode == 2
    assert "plan does not search with tensor parallel yet (tp_size=2)" in result.stderr
