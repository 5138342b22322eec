"""Expert parallel (`ep_size`): the split sizes a traced rank assumes, what a rank holds and receives, the time of its
all-to-alls and of FSDP's collectives over the experts, and its bad input.

What a traced rank holds is checked against PyTorch's FSDPMemTracker on a real step over gloo in
test_fsdp_accuracy.py (`test_expert_parallel_over_gloo`, EP_CASES); here, what needs no second process.
"""

from __future__ import annotations

import json

import pytest

from anatomist.estimate.predict import estimate
from anatomist.estimate.time.collectives import collectives, expert_parallel_s
from anatomist.estimate.time.ops import step_ops
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.depth.plan import model_plan
from anatomist.trace.engine.records import COLLECTIVE_PREFIX
from anatomist.trace.step.experts import split_sizes
from anatomist.workload_loader import load_workload

GPU = get_gpu("H100")
SEQ, BLOCKS, EXPERTS, TOP_K = 32, 2, 8, 2
MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
       "moe_intermediate_size": 64, "num_hidden_layers": BLOCKS, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 16, "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "vocab_size": 500,
       "max_position_embeddings": 128, "tie_word_embeddings": False}


@pytest.fixture
def moe(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MOE))
    return tmp_path, load_workload(str(tmp_path), seq_len=SEQ)


def _recipe(**fields):
    return Recipe(per_device_train_batch_size=2, dtype="float32", optim="adamw_torch", fsdp="full_shard", **fields)


@pytest.mark.parametrize(("tokens", "ep"), [(64, 2), (64, 4), (63, 4), (5, 8)])
def test_split_sizes_send_every_pair_and_receive_what_the_routing_sends(tokens, ep):
    """Balanced: a rank's T x k pairs spread over the group, as many received; skewed: every token's picks of rank 0's
    experts (as many as top-k allows) from every rank of the group, its other picks spread over the other ranks."""
    pairs = tokens * TOP_K
    send, receive = split_sizes(tokens, TOP_K, EXPERTS, ep, "balanced")
    assert sum(send) == sum(receive) == pairs and max(send) - min(send) <= 1
    send, receive = split_sizes(tokens, TOP_K, EXPERTS, ep, "skewed")
    mine = tokens * min(TOP_K, EXPERTS // ep)
    assert sum(send) == pairs and send[0] == mine
    assert receive == [mine] * ep


def test_the_experts_are_counted_for_the_collectives(moe):
    """The routed experts' weights (`base_model_ep_plan`'s grouped_gemm entries): 2 layers x 8 experts x (the fused
    gate and up projection, 2 x 64 x 64, and the down projection, 64 x 64)."""
    _, workload = moe
    size = model_plan(workload, _recipe().resolved(workload), use_cache=False).size
    assert size.expert_parameters == BLOCKS * EXPERTS * 3 * 64 * 64


def test_fsdp_gathers_no_expert_where_each_lives_on_one_gpu(moe):
    """With ep_size = GPUs each expert lives whole on one rank: FSDP gathers and reduces the dense weights only."""
    _, workload = moe
    plain, split = (_recipe(**fields).resolved(workload) for fields in ({}, {"ep_size": 4}))
    size = model_plan(workload, plain, use_cache=False).size
    gathered = {r.ep_size: collectives(r, size, num_gpus=4, gpu=GPU) for r in (plain, split)}
    dense = 1 - size.expert_parameters / size.parameters
    assert gathered[4].gather_forward_s == pytest.approx(gathered[1].gather_forward_s * dense, rel=1e-9)
    assert gathered[4].reduce_s < gathered[1].reduce_s


@pytest.mark.slow  # 9 s on 2 cores: traces at both routings
def test_a_rank_receives_more_where_the_routing_is_skewed(moe):
    """The estimate's range runs from balanced to skewed routing, each traced; the skewed rank keeps more (its experts'
    rows, ep_size times a balanced rank's at top-2 of 4 experts a rank); the note and the JSON say both."""
    _, workload = moe
    result = estimate(workload, _recipe(ep_size=2), GPU, num_gpus=2)
    low, high = result.moe.peak_range_bytes
    assert low == result.memory.anatomy.peak_allocated < high
    assert result.to_dict()["moe"]["received_rows_range"] == [2 * SEQ * TOP_K, 2 * 2 * SEQ * TOP_K]
    (note,) = [n for n in result.memory.notes if n.startswith("Mixture of Experts, expert parallel over 2 GPUs")]
    assert "each holds 4 of the 8 experts" in note


def test_the_all_to_alls_are_timed_and_cross_nodes_slower(moe):
    """Each MoE layer's rank runs two all-to-alls in forward (the tokens out, the outputs back) and two in backward;
    none hidden, at the node's bus bandwidth in one node and, where the group spans nodes, through the network."""
    _, workload = moe
    recipe = _recipe(ep_size=2).resolved(workload)
    ops = step_ops(workload, recipe, GPU.compute_capability)
    calls = {r.phase.value: r.count for r in ops.records if r.name == COLLECTIVE_PREFIX + "all_to_all_single"}
    assert calls == {"forward": 2 * BLOCKS, "backward": 2 * BLOCKS}
    one_node = expert_parallel_s(ops, recipe, 2, 1, gpu=GPU)
    assert 0 < one_node < expert_parallel_s(ops, recipe, 2, 2, "ethernet-100g", gpu=GPU)


@pytest.mark.parametrize(("flags", "message"), [
    (["--gpus", "2", "--ep-size", "2"], "ep_size=2 is modelled with FSDP over the GPUs"),
    (["--gpus", "6", "--fsdp", "full_shard", "--ep-size", "4"], "ep_size=4 does not divide the 6 GPUs"),
    (["--gpus", "6", "--fsdp", "full_shard", "--ep-size", "3"], "ep_size=3 does not divide its 8 routed experts"),
    (["--gpus", "4", "--fsdp", "full_shard", "--ep-size", "2", "--tp-size", "2"], "ep_size=2 with tp_size=2 is not"),
    (["--gpus", "4", "--fsdp", "full_shard", "--ep-size", "2", "--peft", "lora"], "ep_size=2 with LoRA/QLoRA"),
    (["--gpus", "4", "--fsdp", "full_shard", "--ep-size", "0"], "ep_size must be at least 1, got 0"),
    (["--gpus", "4", "--fsdp", "full_shard", "--ep-size", "2", "--experts-implementation", "batched_mm"],
     "ep_size=2 with experts_implementation=batched_mm is not modelled"),
    (["--gpus", "4", "--fsdp", "full_shard", "--ep-size", "2", "--ep-routing", "uniform"], "invalid choice: 'uniform'"),
    (["--gpus", "4", "--fsdp", "full_shard", "--ep-routing", "skewed"], "ep_routing=skewed without expert parallel"),
])
def test_bad_input_is_one_line(cli, moe, flags, message):
    path, _ = moe
    result = cli("estimate", str(path), "--seq-len", str(SEQ), "--gpu", "H100", *flags)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert message in result.stderr


def test_a_dense_model_has_no_experts_to_split(cli, tiny_model):
    llama = tiny_model("llama")
    result = cli("estimate", str(llama), "--seq-len", "32", "--gpu", "H100", "--gpus", "2", "--fsdp", "full_shard",
                 "--ep-size", "2")
    assert result.returncode == 2
    assert "ep_size=2 is expert parallel, for a Mixture of Experts; this model has no experts" in result.stderr


@pytest.mark.slow  # ~60 s on 2 cores: a plan over a Mixture of Experts, its expert parallel ranks traced
def test_the_plan_spreads_the_experts_where_nothing_fits_without_it(tmp_path):
    """On 4 GPUs whose memory lies between what expert parallel over transformers' FSDP needs (it trains the bfloat16
    model in bfloat16) and what accelerate's FSDP over 4 needs (it upcasts it to fp32 masters), the plan spreads the
    experts of the recipes that do not fit, picks one, names it in its sharding line and writes it as transformers
    loads it."""
    from dataclasses import replace

    from anatomist.plan import SearchSpace, plan
    from anatomist.plan.emit import trainer_snippet

    wide = {**MOE, "hidden_size": 256, "moe_intermediate_size": 512, "num_hidden_layers": 4, "dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(wide))
    workload = load_workload(str(tmp_path), seq_len=SEQ)
    space = {"global_batch_size": 8, "num_gpus": 4, "optims": ("adamw_torch",), "compile_options": (False,),
             "liger_options": (False,), "shardings": ("fsdp_full_shard",), "offload_checkpoints": False,
             "partial_checkpointing": (), "precisions": ("bf16-weights",)}
    unsplit = plan(workload, GPU, space=SearchSpace(**space, tensor_parallel=False), margin=0.0, objective="memory")
    smallest = min(c.device_total_high for c in unsplit.candidates)
    small_gpu = replace(GPU, memory_bytes=smallest - 2**20)
    result = plan(workload, small_gpu, space=SearchSpace(**space), margin=0.0)
    assert result.best.recipe.ep_size > 1 and result.best.fits
    sharding = next(line for line in result.best.reasons if line.startswith("sharding"))
    assert sharding.startswith(f"sharding fsdp_full_shard+ep{result.best.recipe.ep_size}")
    assert any(note.startswith("expert parallel: tried over 2, 4 GPUs") for note in result.notes)
    snippet = trainer_snippet(result.best.recipe, 4, model="Qwen/Qwen3-30B-A3B", task="causal-lm")
    assert f"ep_size={result.best.recipe.ep_size}" in snippet and "distributed_config=distributed_config" in snippet


def test_an_expert_parallel_recipe_is_written_as_transformers_loads_it(tmp_path):
    """The Trainer's files: its arguments without accelerate's FSDP (transformers shards the model as it loads), the
    snippet's DistributedConfig rebuilt as transformers reads it; the files that cannot say it refuse in one line."""
    import ast

    from transformers import DistributedConfig, TrainingArguments

    from anatomist.errors import InputError
    from anatomist.plan.emit import render, write

    recipe = Recipe(per_device_train_batch_size=1, bf16=True, fsdp="full_shard", ep_size=4)
    args, snippet, *_ = write(recipe, "trainer", tmp_path / "args.json", 8, model="Qwen/Qwen3-30B-A3B",
                              task="causal-lm")
    kwargs = json.loads(args.read_text())
    assert "fsdp" not in kwargs and "fsdp_config" not in kwargs
    TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", **kwargs)
    calls = [node for node in ast.walk(ast.parse(snippet.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "DistributedConfig"]
    config = DistributedConfig(**{k.arg: ast.literal_eval(k.value) for k in calls[0].keywords})
    assert (config.ep_size, config.fsdp_size, config.efsdp_size) == (4, 8, 2)
    for target in ("accelerate", "deepspeed", "trl"):
        with pytest.raises(InputError, match="expert parallel is set where transformers loads the model"):
            render(recipe, target, 8)
