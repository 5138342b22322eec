"""HSDP (`dp_replicate_size`): FSDP's shard groups replicated, as accelerate's FSDP2 runs it on its 2-D mesh.

What a rank holds is checked against FSDPMemTracker on a real step in test_fsdp_accuracy.py
(`test_hybrid_sharding`, slow: -0.02% and -0.01% of the peak, where FSDP over all four ranks would be -20%); here what
needs no second process: a rank is traced as one of its shard group, the time moves the gathers and reduce-scatters
inside the group and adds the all-reduce across the replicas, the files that say it are read, and bad input is one
line.
"""

from __future__ import annotations

import json

import pytest

from anatomist.estimate.memory import estimate_memory
from anatomist.estimate.time.collectives import collectives
from anatomist.estimate.time.network import bus_bytes_per_s, node_network_bytes_per_s
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.recipe.files import read_recipe_file
from anatomist.trace.store.keys import traced_world
from anatomist.workload_loader import load_workload

GPU = get_gpu("H100")
SEQ = 64


@pytest.fixture
def llama(tiny_model):
    path = tiny_model("llama", num_hidden_layers=2, hidden_size=128, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512)
    return path, load_workload(str(path), seq_len=SEQ)


def test_a_rank_holds_what_a_rank_of_its_shard_group_holds(llama):
    """Two replicas of FSDP over 4 on 8 GPUs: each rank traced as one of FSDP over its group of 4, the same bytes."""
    _, workload = llama
    hybrid = Recipe(per_device_train_batch_size=2, fsdp="full_shard", dp_replicate_size=2).resolved(workload)
    assert traced_world(hybrid, 8) == 4
    plain = hybrid.replace(dp_replicate_size=1)
    assert (estimate_memory(workload, hybrid, GPU, num_gpus=8).anatomy.peak_allocated
            == estimate_memory(workload, plain, GPU, num_gpus=4).anatomy.peak_allocated)


def test_the_collectives_stay_in_the_group_but_the_replicas_all_reduce(llama):
    """2 nodes of 8 over 100 Gb Ethernet: FSDP over 16 gathers across the nodes; HSDP 2 x 8 gathers inside a node
    and all-reduces 1/8 of the gradients across the two, eight rings at once through each node's one port, so the
    step's exposed communication shrinks."""
    from anatomist.estimate.traces import step_traces

    _, workload = llama
    hybrid = Recipe(per_device_train_batch_size=2, fsdp="full_shard", dp_replicate_size=2).resolved(workload)
    size = step_traces(workload, hybrid, GPU.compute_capability, "train", num_gpus=16).size
    across = collectives(hybrid.replace(dp_replicate_size=1), size, num_gpus=16, nodes=2, network="ethernet-100g",
                         gpu=GPU)
    within = collectives(hybrid, size, num_gpus=16, nodes=2, network="ethernet-100g", gpu=GPU)
    intra, inter = bus_bytes_per_s(8, 1, None, GPU), node_network_bytes_per_s(8, "ethernet-100g") / 8
    assert within.gather_forward_s == pytest.approx(across.gather_forward_s * (7 / 8) / (15 / 16)
                                                    * bus_bytes_per_s(16, 2, "ethernet-100g", GPU) / intra)
    gradients = across.reduce_s * bus_bytes_per_s(16, 2, "ethernet-100g", GPU) / (15 / 16)
    assert within.reduce_s == pytest.approx(7 / 8 * gradients / intra + 2 * (1 / 2) * gradients / 8 / inter)
    assert within.exposed_s(1.0, 2.0) < across.exposed_s(1.0, 2.0)


@pytest.mark.parametrize(("name", "text"), [
    ("accelerate.yaml", "distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n"
                        "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
                        "  parallelism_config_dp_shard_size: 4\n"),
    ("args.yaml", "per_device_train_batch_size: 1\nfsdp: full_shard\nparallelism_config:\n  dp_replicate_size: 2\n"
                  "  dp_shard_size: 4\n"),
    ("axolotl.yaml", "base_model: meta-llama/Llama-3.1-8B\nmicro_batch_size: 1\nsequence_len: 1024\n"
                     "fsdp_version: 2\nfsdp_config:\n  reshard_after_forward: true\ndp_replicate_size: 2\n"),
])
def test_the_files_that_say_it_are_read(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert read_recipe_file(path).recipe.dp_replicate_size == 2


@pytest.mark.parametrize(("flags", "message"), [
    (["--gpus", "8", "--dp-replicate-size", "2"], "replicates FSDP's shards (HSDP): add --fsdp"),
    (["--gpus", "8", "--fsdp", "full_shard", "--dp-replicate-size", "3"], "shard groups of 2 or more"),
    (["--gpus", "8", "--fsdp", "full_shard", "--dp-replicate-size", "8"], "shard groups of 2 or more"),
    (["--gpus", "8", "--fsdp", "full_shard", "--dp-replicate-size", "0"], "dp_replicate_size must be at least 1"),
    (["--gpus", "8", "--fsdp", "full_shard", "--dp-replicate-size", "2", "--tp-size", "2"], "not modelled yet"),
])
def test_bad_input_is_one_line(cli, llama, flags, message):
    path, _ = llama
    result = cli("estimate", str(path), "--seq-len", str(SEQ), "--gpu", "H100", *flags)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert message in result.stderr


def test_plan_holds_a_file_s_hybrid_sharding_where_it_is_one_replica_per_node(cli, llama, tmp_path):
    """The plan's HSDP is FULL_SHARD inside each node, one replica per node (`hsdp`): a file that says so is held
    (every candidate HSDP); other replicas are one line."""
    path, _ = llama
    recipe = tmp_path / "args.yaml"
    recipe.write_text("per_device_train_batch_size: 1\nfsdp: full_shard\nparallelism_config:\n  dp_replicate_size: 2\n")
    common = [str(path), "--seq-len", str(SEQ), "--gpu", "H100", "--gpus", "4", "--recipe", str(recipe)]
    result = cli("plan", *common)
    assert result.returncode == 2
    assert "this file has 2 replicas on 1 node(s)" in result.stderr
    planned = cli("plan", *common, "--nodes", "2", "--global-batch-size", "8", "--no-compile", "--json")
    assert planned.returncode == 0, planned.stderr
    out = json.loads(planned.stdout)
    assert out["best"]["recipe"]["dp_replicate_size"] == 2 and out["best"]["recipe"]["fsdp"] == "full_shard"
    assert all(c["recipe"]["dp_replicate_size"] == 2 for c in out["pareto"])
