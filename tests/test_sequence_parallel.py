"""DeepSpeed's sequence parallel (`sp_size`, Ulysses as accelerate runs it): what a traced rank computes and exchanges,
the time of its all-to-alls, how it is written and read, and its bad input.

What a rank holds is checked against DeepSpeed's own run in test_deepspeed_accuracy.py (`SP_CASES`: transformers'
Trainer, accelerate's ParallelismConfig, DeepSpeed's Ulysses and ZeRO over gloo, MemTracker on each rank); here, what
needs no second process.
"""

from __future__ import annotations

import json

import pytest

from anatomist.anatomy import Phase
from anatomist.estimate.memory import estimate_memory, moment_peaks
from anatomist.estimate.predict import estimate
from anatomist.estimate.time.collectives import sequence_parallel_s
from anatomist.estimate.time.ops import step_ops
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.engine.records import ATTENTION_PREFIX, ULYSSES_ALL_TO_ALL
from anatomist.workload_loader import load_workload
from tests.conftest import (
    GQA_BLOCKS,
    GQA_HEAD_DIM,
    GQA_HEADS,
    GQA_KV_HEADS,
    GQA_SEQ,
    refused_in_one_line,
    write_config,
)

pytest.importorskip("deepspeed")

GPU = get_gpu("H100")
SEQ, HEADS, KV_HEADS, HEAD_DIM, BLOCKS = GQA_SEQ, GQA_HEADS, GQA_KV_HEADS, GQA_HEAD_DIM, GQA_BLOCKS


def _recipe(**fields):
    return Recipe(**{"per_device_train_batch_size": 2, "dtype": "float32", "optim": "adamw_torch", "zero_stage": 2,
                     **fields})


def _forward_attention_flops(ops):
    return sum(r.flops * r.count for r in ops.records if r.name.startswith(ATTENTION_PREFIX)
               and r.phase is Phase.FORWARD and "backward" not in r.name)


@pytest.mark.parametrize("sp", [2, 4])
def test_a_rank_attends_over_the_whole_sequence_with_its_share_of_the_heads(gqa_llama, sp):
    """After DeepSpeed's all-to-all a rank's SDPA sees every token of 1/sp of the heads: 1/sp of the sequence's
    attention (at sp 4 each rank gets one of the 2 key/value heads, repeated as DeepSpeed repeats it); the rest of
    the model runs on its S / sp tokens."""
    _, workload = gqa_llama
    whole = step_ops(workload, _recipe().resolved(workload))
    rank = step_ops(workload, _recipe(sp_size=sp).resolved(workload))
    assert _forward_attention_flops(rank) * sp == pytest.approx(_forward_attention_flops(whole), rel=1e-6)
    assert rank.flops(Phase.FORWARD) < whole.flops(Phase.FORWARD) / sp * 1.2


def test_the_exchanges_are_in_the_trace_and_priced(gqa_llama):
    """Per layer four all-to-alls in forward (queries, keys, values, the attention's output) and four in backward,
    each as big as the rank's tensor: batch x S/sp x heads x head size, in and out."""
    _, workload = gqa_llama
    sp = 2
    recipe = _recipe(sp_size=sp).resolved(workload)
    ops = step_ops(workload, recipe)
    exchanges = [r for r in ops.records if r.name == ULYSSES_ALL_TO_ALL]
    assert sum(r.count for r in exchanges) == 8 * BLOCKS
    tokens = 2 * SEQ // sp
    one_layer = tokens * (HEADS + 2 * KV_HEADS + HEADS) * HEAD_DIM * 4 * 2  # q, k, v, out; fp32; in + out
    assert sum(r.bytes * r.count for r in exchanges) == 2 * BLOCKS * one_layer
    assert sequence_parallel_s(ops, recipe, GPU) > 0
    assert sequence_parallel_s(ops, recipe.replace(sp_size=1), GPU) == 0


def test_transformers_attention_registry_is_left_as_it_was(gqa_llama):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _, workload = gqa_llama
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    step_ops(workload, _recipe(sp_size=2).resolved(workload))
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa


def test_a_group_trains_one_batch(gqa_llama):
    """On 8 GPUs at sp 4 two groups train: samples/s counts 2 batches per step; ZeRO partitions the states over all 8
    GPUs; the activations are a quarter of each sequence's."""
    _, workload = gqa_llama
    plain = estimate(workload, _recipe(), GPU, num_gpus=8)
    split = estimate(workload, _recipe(sp_size=4), GPU, num_gpus=8)
    assert split.time.samples_per_second * split.time.step_s == pytest.approx(2 * 2)
    assert split.time.tokens_per_second == pytest.approx(split.time.samples_per_second * SEQ)
    assert split.memory.anatomy.optimizer_states == plain.memory.anatomy.optimizer_states
    assert any(n.startswith("sequence parallel 4: one rank traced") for n in split.memory.notes)


def test_a_zero_peak_is_the_highest_point_once_sharded(gqa_llama):
    """Under ZeRO the peak is the point highest in what stays on a device (ZeRO-3 replaces the traced gradients and
    gathered weights with its own): no moment of the step, sharded, is above it. (The highest traced point, sharded,
    was 6% under DeepSpeed's own peak with checkpointing, test_deepspeed_accuracy's SP_CASES.)"""
    _, workload = gqa_llama
    recipe = _recipe(zero_stage=3, sp_size=2, gradient_checkpointing=True, bf16=True,
                     dtype="bfloat16").resolved(workload)
    peak = estimate_memory(workload, recipe, GPU, num_gpus=2).anatomy.peak_allocated
    moments = moment_peaks(workload, recipe, GPU, num_gpus=2)
    assert peak == max(p.allocated for p in moments.values())


def test_the_estimate_says_sequence_parallel(cli, gqa_llama):
    path, _ = gqa_llama
    args = ("estimate", str(path), "--seq-len", str(SEQ), "--gpu", "H100", "--gpus", "4", "--zero-stage", "3",
            "--sp-size", "2")
    result = cli(*args, "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["recipe"]["sp_size"] == 2
    assert any(n.startswith("sequence parallel 2: one rank traced") for n in out["notes"])
    text = cli(*args)
    assert "sharding zero3+sp2" in text.stdout and "DeepSpeed" not in text.stderr, text.stderr


@pytest.mark.parametrize(("flags", "message"), [
    (["--gpus", "4", "--sp-size", "2"], "add --zero-stage"),
    (["--gpus", "4", "--fsdp", "full_shard", "--sp-size", "2"], "add --zero-stage"),
    (["--gpus", "6", "--zero-stage", "2", "--sp-size", "4"], "does not divide the 6 GPU(s)"),
    (["--gpus", "2", "--nodes", "2", "--zero-stage", "2", "--sp-size", "4"], "across nodes"),
    (["--gpus", "4", "--zero-stage", "2", "--sp-size", "2", "--peft", "qlora"], "QLoRA"),
    (["--gpus", "4", "--zero-stage", "2", "--sp-size", "2", "--use-liger-kernel"], "Liger"),
    (["--gpus", "4", "--zero-stage", "2", "--sp-size", "2", "--attn-implementation", "eager"], "DeepSpeed refuses eager"),
    (["--gpus", "4", "--zero-stage", "2", "--sp-size", "2", "--trainer", "sft"], "SFTTrainer"),
    (["--gpus", "4", "--zero-stage", "2", "--sp-size", "0"], "at least 1"),
    (["--gpus", "8", "--zero-stage", "2", "--sp-size", "8"], "does not divide its 4 attention heads"),
    (["--gpus", "2", "--zero-stage", "2", "--sp-size", "2", "--mode", "inference"], "drop --cp-size / --sp-size"),
    (["--gpus", "4", "--zero-stage", "2", "--sp-size", "4", "--seq-len", "66"], "sp_size = 4 equal parts"),
])
def test_bad_input_is_one_line(cli, gqa_llama, flags, message):
    path, _ = gqa_llama
    seq = [] if "--seq-len" in flags else ["--seq-len", str(SEQ)]
    refused_in_one_line(cli("estimate", str(path), *seq, "--gpu", "H100", *flags), message)


@pytest.mark.parametrize(("model", "overrides", "message"), [
    ("bert", {}, "splits causal LM sequences"),
    ("llama", {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 32},
     "sliding_attention"),
    ("llama", {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}, "3 key/value heads"),
    ("gpt2", {}, "num_key_value_heads, which this gpt2 config has not"),
])
def test_models_ulysses_cannot_split(cli, tmp_path, model, overrides, message):
    path = write_config(tmp_path, model, **overrides)
    result = cli("estimate", str(path), "--seq-len", str(SEQ), "--gpu", "H100", "--gpus", "2", "--zero-stage", "2",
                 "--sp-size", "2")
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_recipe_files_say_sequence_parallel(tmp_path):
    """TRL's ALST example (accelerate's `parallelism_config_sp_size`, its attention flash_attention_2, its dp_shard_size
    DeepSpeed's data parallel ranks) and TrainingArguments' `parallelism_config` are read as sp_size; an attention
    DeepSpeed's Ulysses would wrap that is not modelled is refused."""
    from anatomist.errors import InputError
    from anatomist.recipe.files import read_recipe_file
    from tests.test_recipe_corpus import DATA

    trl = DATA / "trl/examples/accelerate_configs/alst_ulysses_4gpu.yaml"
    read = read_recipe_file(trl).recipe
    assert (read.sp_size, read.zero_stage, read.attn_implementation, read.dp_replicate_size) == (
        2, 3, "flash_attention_2", 1)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    arguments = tmp_path / "args.json"
    arguments.write_text(json.dumps({"deepspeed": "ds.json", "parallelism_config": {
        "sp_size": 4, "sp_backend": "deepspeed", "dp_replicate_size": 2}}))
    assert (read_recipe_file(arguments).recipe.sp_size, read_recipe_file(arguments).recipe.dp_replicate_size) == (4, 1)
    kernel = tmp_path / "fa3.yaml"
    kernel.write_text(trl.read_text().replace("sp_attn_implementation: flash_attention_2",
                                              "sp_attn_implementation: flash_attention_3"))
    with pytest.raises(InputError, match="sp_attn_implementation='flash_attention_3' is not modelled"):
        read_recipe_file(kernel)


@pytest.mark.slow  # about a minute on 2 cores: the recipes traced at 4,096 tokens, then split over 2 and 4 ranks
def test_the_plan_splits_the_sequences_of_zero_recipes_where_nothing_fits(tmp_path):
    """On 4 GPUs whose memory is less than any ZeRO-3 recipe without sequence parallel needs (a long sequence's logits
    hold the peak), the plan splits the sequences over 2 or 4 GPUs with DeepSpeed's Ulysses, picks a split one that
    fits, names it in its sharding line and writes it as accelerate's ParallelismConfig with the DeepSpeed
    sequence parallel handler."""
    from dataclasses import replace

    from anatomist.plan import SearchSpace, plan
    from anatomist.plan.emit import accelerate_config

    path = write_config(tmp_path, "llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=2, vocab_size=32000, max_position_embeddings=4096)
    workload = load_workload(str(path), seq_len=4096)
    space = {"global_batch_size": 4, "num_gpus": 4, "optims": ("adamw_torch",), "compile_options": (False,),
             "liger_options": (False,), "shardings": ("zero3",), "offload_checkpoints": False,
             "partial_checkpointing": (), "precisions": ("fp32",)}
    unsplit = plan(workload, GPU, space=SearchSpace(**space, tensor_parallel=False), margin=0.0, objective="memory")
    smallest = min(c.device_total_high for c in unsplit.candidates)
    result = plan(workload, replace(GPU, memory_bytes=smallest - 2**20), space=SearchSpace(**space), margin=0.0)
    sp = result.best.recipe.sp_size
    assert sp > 1 and result.best.fits
    sharding = next(line for line in result.best.reasons if line.startswith("sharding"))
    assert sharding.startswith(f"sharding zero3+sp{sp}")
    assert any(note.startswith("sequence parallel (DeepSpeed's Ulysses): tried over 2, 4 GPUs") for note in result.notes)
    section = accelerate_config(result.best.recipe, 4)["parallelism_config"]
    assert (section["parallelism_config_sp_size"], section["parallelism_config_sp_backend"]) == (sp, "deepspeed")
