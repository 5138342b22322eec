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


def test_plan_says_it_does_not_hold_a_tensor_parallel_size_fixed(cli, llama, tmp_path):
    path, _ = llama
    recipe = tmp_path / "args.yaml"
    recipe.write_text("per_device_train_batch_size: 1\nparallelism_config:\n  tp_size: 2\n")
    result = cli("plan", str(path), "--seq-len", str(SEQ), "--gpu", "H100", "--gpus", "2", "--recipe", str(recipe))
    assert result.returncode == 2
    assert "plan does not hold a tensor parallel size fixed yet (tp_size=2)" in result.stderr


# -- plan: tensor parallel tried where nothing fits without it, and written for the Trainer --------------------------

WIDE = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16,
        "num_key_value_heads": 8, "vocab_size": 512, "dtype": "bfloat16"}
"""A Llama whose weights outweigh its activations (a small vocabulary: no logits to speak of), loaded in bfloat16."""


def test_the_plan_tries_the_group_sizes_the_model_and_the_nodes_allow(llama, tiny_model):
    from anatomist.plan.space import SearchSpace, tensor_parallel_sizes

    wide = load_workload(str(tiny_model("llama", **WIDE)), seq_len=SEQ)
    assert tensor_parallel_sizes(SearchSpace(num_gpus=8), wide) == [2, 4, 8]
    assert tensor_parallel_sizes(SearchSpace(num_gpus=8, nodes=2), wide) == [2, 4]  # a group within a node
    assert tensor_parallel_sizes(SearchSpace(num_gpus=12), wide) == [2, 4]  # 8 does not divide 12 GPUs
    assert tensor_parallel_sizes(SearchSpace(num_gpus=8), llama[1]) == [2]  # its 2 key/value heads split no further
    assert tensor_parallel_sizes(SearchSpace(num_gpus=8, tensor_parallel=False), wide) == []
    assert tensor_parallel_sizes(SearchSpace(num_gpus=1), wide) == []
    bert = load_workload(str(tiny_model("bert")), seq_len=32)
    assert tensor_parallel_sizes(SearchSpace(num_gpus=8), bert) == []  # no tp_plan


def test_an_emit_target_that_cannot_say_tensor_parallel_leaves_it_out_of_the_search():
    from anatomist.cli import build_parser
    from anatomist.cli.requests import plan_request

    def request(*flags: str):
        return plan_request(build_parser().parse_args(["plan", "Llama-3.2-1B", "--gpu", "H100", *flags]))

    assert not request().no_tensor_parallel
    assert not request("--emit", "trainer").no_tensor_parallel
    assert request("--emit", "accelerate").no_tensor_parallel
    assert request("--no-tensor-parallel").no_tensor_parallel


def test_a_tensor_parallel_recipe_is_written_as_transformers_loads_it(tmp_path):
    """The Trainer's snippet loads the model with transformers' own DistributedConfig (rebuilt here from the snippet's
    call), the TrainingArguments hold no FSDP of accelerate's (transformers shards the groups as it loads), and the
    files that cannot say it refuse in one line."""
    import ast
    import json

    from transformers import DistributedConfig, TrainingArguments

    from anatomist.errors import InputError
    from anatomist.plan.caveats import launch_warnings
    from anatomist.plan.emit import render, write

    recipe = Recipe(per_device_train_batch_size=2, bf16=True, fsdp="full_shard", tp_size=2)
    args, snippet, *_ = write(recipe, "trainer", tmp_path / "args.json", 8, model="meta-llama/Llama-3.1-8B",
                              task="causal-lm")
    kwargs = json.loads(args.read_text())
    assert "fsdp" not in kwargs and "fsdp_config" not in kwargs
    TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", **kwargs)
    calls = [node for node in ast.walk(ast.parse(snippet.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "DistributedConfig"]
    config = DistributedConfig(**{k.arg: ast.literal_eval(k.value) for k in calls[0].keywords})
    assert (config.tp_size, config.fsdp_size, config.fsdp_mixed_precision) == (2, 4, True)
    assert "distributed_config=distributed_config" in snippet.read_text()
    assert any("from_pretrained(distributed_config=...)" in w for w in launch_warnings(recipe, "trainer"))
    for target in ("accelerate", "deepspeed", "trl"):
        with pytest.raises(InputError, match="only --emit trainer writes"):
            render(recipe, target, 8)


@pytest.mark.slow  # 35-60 s on 2 cores: tensor parallel ranks of a 2048-wide model traced at two world sizes
def test_the_plan_picks_tensor_parallel_where_nothing_fits_without_it(tiny_model):
    """On 4 GPUs whose memory lies between what tensor parallel 2 x FSDP 2 and accelerate's FSDP over 4 need (the
    former trains the bfloat16 model in bfloat16, the latter upcasts it to fp32 masters), the plan splits the
    recipes that do not fit, picks a split one, and says why in its sharding line."""
    from dataclasses import replace

    from anatomist.plan import SearchSpace, plan
    from anatomist.plan.search import fastest_fitting

    wide = load_workload(str(tiny_model("llama", **WIDE, max_position_embeddings=2048)), seq_len=2048)
    space = {"global_batch_size": 4, "num_gpus": 4, "optims": ("adamw_torch",), "compile_options": (False,),
             "liger_options": (False,), "shardings": ("fsdp_full_shard",), "offload_checkpoints": False,
             "partial_checkpointing": (), "precisions": ("bf16-weights",)}
    unsplit = plan(wide, GPU, space=SearchSpace(**space, tensor_parallel=False), margin=0.0, objective="memory")
    smallest = min(c.device_total_high for c in unsplit.candidates)
    small_gpu = replace(GPU, memory_bytes=smallest - 2**29)
    result = plan(wide, small_gpu, space=SearchSpace(**space), margin=0.0)
    assert result.best.recipe.tp_size == 2 and result.best.fits
    assert result.best.recipe.per_device_train_batch_size * result.best.recipe.gradient_accumulation_steps == 2
    sharding = next(line for line in result.best.reasons if line.startswith("sharding"))
    assert sharding.startswith("sharding fsdp_full_shard+tp2") and "fsdp_full_shard at 1 x 1 would not fit" in sharding
    # tp 4 is one group of every GPU, which runs without FSDP: not searched under --shardings fsdp_full_shard
    assert any(note.startswith("tensor parallel: tried in groups of 2 on") for note in result.notes)
    # what `plan --max-nodes` asks of each cluster size, predicting the memory of fewer recipes: the same pick
    assert fastest_fitting(wide, small_gpu, space=SearchSpace(**space), margin=0.0).recipe == result.best.recipe
