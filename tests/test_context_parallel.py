"""Context parallel (`cp_size`): what a traced rank computes and holds, the time of its ring, and its bad input.

What a traced rank holds is checked against PyTorch's FSDPMemTracker on real steps over gloo in test_fsdp_accuracy.py
(`test_context_parallel_over_gloo`, CP_CASES: torch's own ring attention, as the Trainer runs it under accelerate);
here, what needs no second process.
"""

from __future__ import annotations

import json

import pytest

from anatomist.anatomy import Phase
from anatomist.estimate.predict import estimate
from anatomist.estimate.time.collectives import context_parallel_s
from anatomist.estimate.time.ops import step_ops
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.engine.records import ATTENTION_PREFIX, COLLECTIVE_PREFIX
from anatomist.workload_loader import load_workload
from tests.conftest import GQA_HEAD_DIM, GQA_HEADS, GQA_SEQ, refused_in_one_line, write_config

GPU = get_gpu("H100")
SEQ, HEADS, HEAD_DIM = GQA_SEQ, GQA_HEADS, GQA_HEAD_DIM


def _recipe(**fields):
    return Recipe(per_device_train_batch_size=2, dtype="float32", optim="adamw_torch", fsdp="full_shard", **fields)


def _attention_flops(ops, phase):
    return sum(r.flops * r.count for r in ops.records if r.name.startswith(ATTENTION_PREFIX) and r.phase is phase
               and "backward" not in r.name)


@pytest.mark.parametrize("cp", [2, 4])
def test_a_rank_computes_its_share_of_the_causal_attention(gqa_llama, cp):
    """torch's load-balanced ring: a rank's attention steps (its own part causal, then half of them against every other
    rank's keys and values), counted as the time model counts one GPU's causal attention (the kernel's whole product,
    `ops._ring_in_causal_convention`), are 1/cp of the whole sequence's; the rest of the model runs on its S / cp
    tokens. (As traced, the steps are (S/cp)^2 + (cp - 1) x S/2cp x S/cp = (cp + 1) / 2cp^2 of S^2: the same
    statement.)"""
    _, workload = gqa_llama
    recipe = _recipe(cp_size=cp).resolved(workload).replace(fsdp="none")
    whole = step_ops(workload, _recipe().resolved(workload).replace(fsdp="none"))
    rank = step_ops(workload, recipe)
    assert _attention_flops(rank, Phase.FORWARD) * cp == pytest.approx(_attention_flops(whole, Phase.FORWARD), rel=1e-5)
    assert rank.flops(Phase.FORWARD) < whole.flops(Phase.FORWARD) / cp * 1.2


def test_the_ring_s_collectives_are_in_the_trace_and_priced(gqa_llama):
    """Each layer all-gathers the group's keys and values in forward and again in backward; backward passes the key
    and value gradients (float32) to the next rank at each of the cp steps."""
    _, workload = gqa_llama
    cp, blocks = 4, 2
    recipe = _recipe(cp_size=cp).resolved(workload)
    ops = step_ops(workload, recipe.replace(fsdp="none"))
    gathers = [r for r in ops.records if r.name == COLLECTIVE_PREFIX + "all_gather_into_tensor"]
    passes = [r for r in ops.records if r.name == COLLECTIVE_PREFIX + "all_to_all_single"]
    assert sum(r.count for r in gathers) == 2 * blocks
    assert sum(r.count for r in passes) == cp * blocks
    local_kv = 2 * 2 * (SEQ // cp) * 2 * HEAD_DIM * 4  # k and v: batch 2, S / cp tokens, 2 heads, fp32
    assert sum(r.bytes * r.count for r in gathers) == 2 * blocks * (cp + 1) * local_kv
    assert sum(r.bytes * r.count for r in passes) == cp * blocks * 2 * local_kv
    assert context_parallel_s(ops, recipe, GPU) > 0
    assert context_parallel_s(ops, recipe.replace(cp_size=1), GPU) == 0


def test_a_group_trains_one_batch(gqa_llama):
    """On 8 GPUs at cp 4 two groups train: samples/s counts 2 per step, tokens/s every token of them; the weights
    are FSDP's over all 8 GPUs, the activations a quarter of each sequence's."""
    _, workload = gqa_llama
    plain = estimate(workload, _recipe(), GPU, num_gpus=8)
    split = estimate(workload, _recipe(cp_size=4), GPU, num_gpus=8)
    assert split.time.samples_per_second * split.time.step_s == pytest.approx(2 * 2)
    assert split.time.tokens_per_second == pytest.approx(split.time.samples_per_second * SEQ)
    assert split.memory.anatomy.optimizer_states == plain.memory.anatomy.optimizer_states
    assert split.memory.anatomy.activations < plain.memory.anatomy.activations / 2
    assert any(n.startswith("context parallel 4: one rank of 8") for n in split.memory.notes)


def test_the_estimate_says_context_parallel(cli, gqa_llama):
    path, _ = gqa_llama
    result = cli("estimate", str(path), "--seq-len", str(SEQ), "--gpu", "H100", "--gpus", "4", "--fsdp", "full_shard",
                 "--cp-size", "2", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["recipe"]["cp_size"] == 2 and any(n.startswith("context parallel 2: one rank of 4") for n in out["notes"])
    text = cli("estimate", str(path), "--seq-len", str(SEQ), "--gpu", "H100", "--gpus", "4", "--fsdp", "full_shard",
               "--cp-size", "2").stdout
    assert "sharding fsdp_full_shard+cp2" in text


@pytest.mark.parametrize(("flags", "message"), [
    (["--gpus", "4", "--cp-size", "2"], "runs under FSDP2"),
    (["--gpus", "4", "--fsdp", "shard_grad_op", "--cp-size", "2"], "runs under FSDP2"),
    (["--gpus", "6", "--fsdp", "full_shard", "--cp-size", "4"], "does not divide the 6 GPUs"),
    (["--gpus", "8", "--nodes", "2", "--fsdp", "full_shard", "--cp-size", "16"], "a ring across nodes"),
    (["--gpus", "4", "--fsdp", "full_shard", "--cp-size", "2", "--peft", "qlora"], "QLoRA"),
    (["--gpus", "4", "--fsdp", "full_shard", "--cp-size", "2", "--tp-size", "2"], "not modelled yet"),
    (["--gpus", "4", "--fsdp", "full_shard", "--cp-size", "2", "--attn-implementation", "eager"], "needs attn_implementation=sdpa"),
    (["--gpus", "4", "--fsdp", "full_shard", "--cp-size", "2", "--trainer", "sft"], "SFTTrainer"),
    (["--gpus", "4", "--zero-stage", "3", "--cp-size", "2"], "--sp-size"),
    (["--gpus", "4", "--fsdp", "full_shard", "--cp-size", "0"], "at least 1"),
    (["--gpus", "4", "--fsdp", "full_shard", "--cp-size", "2", "--dp-replicate-size", "2"], "dp_shard_size 1"),
    (["--gpus", "8", "--fsdp", "full_shard", "--cp-size", "8", "--seq-len", "40"], "2 x cp_size = 16 equal parts"),
])
def test_bad_input_is_one_line(cli, gqa_llama, flags, message):
    path, _ = gqa_llama
    seq = [] if "--seq-len" in flags else ["--seq-len", str(SEQ)]
    refused_in_one_line(cli("estimate", str(path), *seq, "--gpu", "H100", *flags), message)


@pytest.mark.parametrize(("model", "overrides", "message"), [
    ("bert", {}, "splits causal LM sequences"),
    ("llama", {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 32},
     "sliding_attention"),
])
def test_models_the_ring_cannot_split(cli, tmp_path, model, overrides, message):
    path = write_config(tmp_path, model, **overrides)
    result = cli("estimate", str(path), "--seq-len", str(SEQ), "--gpu", "H100", "--gpus", "2", "--fsdp", "full_shard",
                 "--cp-size", "2")
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_recipe_files_say_context_parallel(tmp_path):
    """accelerate's config (`parallelism_config_cp_size`, TRL's example) and TrainingArguments' `parallelism_config`
    are read as cp_size; the "alltoall" rotation, whose buffers differ from the traced all-gather, is refused."""
    from anatomist.errors import InputError
    from anatomist.recipe.files import read_recipe_file
    from tests.test_recipe_corpus import DATA

    trl = DATA / "trl/examples/accelerate_configs/context_parallel_2gpu.yaml"
    assert read_recipe_file(trl).recipe.cp_size == 2
    arguments = tmp_path / "args.json"
    arguments.write_text(json.dumps({"fsdp": "full_shard", "parallelism_config": {"cp_size": 4, "dp_shard_size": 2}}))
    assert read_recipe_file(arguments).recipe.cp_size == 4
    rotation = tmp_path / "alltoall.yaml"
    rotation.write_text(trl.read_text() + "  parallelism_config_cp_comm_strategy: alltoall\n")
    with pytest.raises(InputError, match="cp_comm_strategy='alltoall' is not modelled"):
        read_recipe_file(rotation)


@pytest.mark.slow  # about a minute on 2 cores: the recipes traced at 4,096 tokens, then split over 2 and 4 ranks
def test_the_plan_splits_the_sequences_where_nothing_fits_without_it(tmp_path):
    """On 4 GPUs whose memory is less than any recipe without context parallel needs (a long sequence's logits hold
    the peak), the plan splits the sequences of the recipes that do not fit over 2 or 4 GPUs, picks a split one
    that fits at the top of its interval (wider than FSDP's: no GPU run of context parallel was published), names it
    in its sharding line and writes it as accelerate's ParallelismConfig."""
    from dataclasses import replace

    from anatomist.plan import SearchSpace, plan
    from anatomist.plan.emit import accelerate_config

    path = write_config(tmp_path, "llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=2, vocab_size=32000, max_position_embeddings=4096)
    workload = load_workload(str(path), seq_len=4096)
    space = {"global_batch_size": 4, "num_gpus": 4, "optims": ("adamw_torch",), "compile_options": (False,),
             "liger_options": (False,), "shardings": ("fsdp_full_shard",), "offload_checkpoints": False,
             "partial_checkpointing": (), "precisions": ("fp32",)}
    unsplit = plan(workload, GPU, space=SearchSpace(**space, tensor_parallel=False), margin=0.0, objective="memory")
    smallest = min(c.device_total_high for c in unsplit.candidates)
    small_gpu = replace(GPU, memory_bytes=smallest - 2**20)
    result = plan(workload, small_gpu, space=SearchSpace(**space), margin=0.0)
    cp = result.best.recipe.cp_size
    assert cp > 1 and result.best.fits
    assert result.best.recipe.per_device_train_batch_size * result.best.recipe.gradient_accumulation_steps == 4 * cp // 4
    sharding = next(line for line in result.best.reasons if line.startswith("sharding"))
    assert sharding.startswith(f"sharding fsdp_full_shard+cp{cp}")
    assert any(note.startswith("context parallel: tried over 2, 4 GPUs") for note in result.notes)
    assert accelerate_config(result.best.recipe, 4)["parallelism_config"]["parallelism_config_cp_size"] == cp
