"""Past one machine: `--nodes N` with `--gpus` per node, the network between the nodes in the time
model, and the accelerate config and launch commands for every node, read back by accelerate and
torchrun's own parsers (CPU, offline, tiny BERT)."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from anatomist.errors import InputError
from anatomist.estimate.predict import estimate
from anatomist.estimate.time.cluster import predict_time
from anatomist.estimate.time.constants import constants
from anatomist.estimate.time.network import bus_bytes_per_s, networks
from anatomist.hardware import get_gpu
from anatomist.plan import SearchSpace, plan
from anatomist.plan.emit import MAIN_NODE, launch_commands, write
from anatomist.recipe import Recipe
from anatomist.recipe.files import read_recipe_file
from anatomist.workload_loader import load_workload
from tests.conftest import write_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return load_workload(str(write_config(tmp_path_factory.mktemp("multi-node"), "bert")), seq_len=64)


A100 = get_gpu("A100-80GB")
ZERO3 = Recipe(per_device_train_batch_size=4, bf16=True, zero_stage=3)


def test_every_network_says_what_it_is_and_where_its_figure_comes_from() -> None:
    assert constants()["inter_node"]["default"] in networks()
    for name, link in networks().items():
        assert link["describe"] and link["source"], name
        assert ("gbit_per_gpu" in link) != ("gbit_per_node" in link), name  # one way of counting, not two


def test_every_gpu_is_joined_by_an_interconnect_with_a_source() -> None:
    from anatomist.hardware import catalog

    kinds = constants()["interconnect"]["kinds"]
    for kind in kinds.values():
        assert kind["bus_gbps"] > 0 and kind["describe"] and kind["source"]
    assert {gpu.interconnect for gpu in catalog().values()} <= set(kinds)
    assert all(gpu.interconnect for gpu in catalog().values())
    # NVLink through NVSwitch outruns PCIe by an order of magnitude (the published 8-GPU figures).
    assert bus_bytes_per_s(8, gpu=get_gpu("H100-SXM")) > 10 * bus_bytes_per_s(8, gpu=get_gpu("H100-PCIe"))


def test_one_node_is_the_time_it_was(tiny) -> None:
    recipe = ZERO3.resolved(tiny)
    before = predict_time(tiny, recipe, A100, num_gpus=8)
    assert predict_time(tiny, recipe, A100, num_gpus=8, nodes=1, network="ethernet-100g") == before


def test_a_slow_network_slows_only_the_collectives(tiny) -> None:
    recipe = ZERO3.resolved(tiny)
    one = predict_time(tiny, recipe, A100, num_gpus=8)
    two = predict_time(tiny, recipe, A100, num_gpus=8, nodes=2, network="ethernet-100g")
    # The same 8 devices (the same ring), split over two machines joined by 100 GbE: the collectives
    # go at the network's pace; nothing else in the step moves.
    slower = bus_bytes_per_s(8, gpu=A100) / bus_bytes_per_s(8, 2, "ethernet-100g", A100)
    assert slower > 5
    def moved(t):
        return t.phases_s["communication"] + t.hidden_communication_s

    assert moved(two) == pytest.approx(moved(one) * slower)
    for t in (one, two):  # the exposed collectives and the sharded optimizer step are "other" time
        assert sum(t.classes_s.values()) == pytest.approx(t.step_s)
        assert sum(t.phases_s.values()) == pytest.approx(t.step_s)
    assert two.phases_s["communication"] > one.phases_s["communication"]
    assert {k: v for k, v in two.phases_s.items() if k != "communication"} == \
        {k: v for k, v in one.phases_s.items() if k != "communication"}
    # A 400 Gb/s NIC per GPU (rail-optimized InfiniBand) carries a node's ring traffic faster than A100s' NVLink
    # achieves, so their bus stays the limit; H100s' NVLink outruns it, so there the network is.
    assert bus_bytes_per_s(16, 2, "infiniband-ndr", A100) == bus_bytes_per_s(16, gpu=A100)
    h100 = get_gpu("H100-SXM")
    assert bus_bytes_per_s(16, 2, "infiniband-ndr", h100) == pytest.approx(8 * 50e9 * 0.9)
    assert bus_bytes_per_s(16, 2, "infiniband-ndr", h100) < bus_bytes_per_s(16, gpu=h100)


def test_memory_per_device_does_not_depend_on_the_nodes(tiny) -> None:
    across = estimate(tiny, ZERO3, A100, num_gpus=8, nodes=2, network="efa-400")
    within = estimate(tiny, ZERO3, A100, num_gpus=8)
    assert across.memory.anatomy.to_dict() == within.memory.anatomy.to_dict()
    assert across.time.step_s > within.time.step_s
    d = across.to_dict()
    assert (d["num_gpus"], d["nodes"], d["network"]) == (8, 2, "efa-400")
    assert "nodes" not in within.to_dict()  # one machine: the JSON 0.x scripts read


@pytest.mark.slow
def test_the_plan_searches_across_nodes(tiny) -> None:
    space = SearchSpace(global_batch_size=16, num_gpus=4, nodes=2, network="ethernet-100g", optims=("adamw_torch",),
                        compile_options=(False,), checkpointing_options=(False,), precisions=("bf16",))
    result = plan(tiny, A100, space=space)
    one_node = plan(tiny, A100, space=replace(space, nodes=1, network=None))
    assert result.best.time.phases_s["communication"] > one_node.best.time.phases_s["communication"]
    d = result.to_dict()
    assert (d["num_gpus"], d["nodes"], d["network"]) == (4, 2, "ethernet-100g")
    assert any("2 nodes, 100 Gb/s Ethernet per node" in note for note in result.notes)
    with pytest.raises(InputError, match="cannot be split evenly over 3 nodes"):
        plan(tiny, A100, space=replace(space, nodes=3))


def test_the_plan_searches_hsdp_across_nodes_only(tiny) -> None:
    """On 2 nodes HSDP (a node's GPUs a shard group, one replica per node) is searched beside FSDP over every GPU:
    its all-gathers stay in the node, only 1/4 of the gradients cross the slow network, so it is the faster of the
    two, for more memory (the state sharded over 2 GPUs, not 4). One node searches no HSDP."""
    space = SearchSpace(global_batch_size=16, num_gpus=4, nodes=2, network="ethernet-100g", optims=("adamw_torch",),
                        compile_options=(False,), checkpointing_options=(False,), precisions=("bf16",),
                        shardings=("fsdp_full_shard", "hsdp"))
    result = plan(tiny, A100, space=space)
    hsdp = [c for c in result.candidates if c.recipe.dp_replicate_size == 2]
    full = [c for c in result.candidates if c.recipe.fsdp == "full_shard" and c.recipe.dp_replicate_size == 1]
    assert hsdp and full and all(c.recipe.fsdp == "full_shard" for c in hsdp)
    pairs = [(h, f) for h in hsdp for f in full if replace(h.recipe, dp_replicate_size=1) == f.recipe]
    assert pairs
    for h, f in pairs:
        assert h.samples_per_second > f.samples_per_second
        assert h.device_total > f.device_total
    assert result.best.recipe.dp_replicate_size == 2
    one_node = replace(space, nodes=1, network=None, shardings=None)
    assert "hsdp" not in [spec.name for spec in one_node.sharding_options()]
    with pytest.raises(InputError, match="hsdp"):
        plan(tiny, A100, space=replace(one_node, shardings=("hsdp",)))


def test_the_accelerate_config_and_every_node_s_command_are_what_accelerate_reads(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    path = tmp_path / "accelerate.yaml"
    write(ZERO3, "accelerate", path, num_gpus=16, nodes=2)
    config = load_config_from_file(str(path))
    assert (config.num_machines, config.num_processes, config.main_process_ip) == (2, 16, MAIN_NODE)
    read = read_recipe_file(path)  # and read back by anatomist as a recipe file: 16 devices on 2 nodes
    assert (read.num_gpus, read.nodes) == (16, 2)
    assert not {"num_machines", "main_process_ip", "main_process_port", "machine_rank"} & set(read.not_modelled)
    commands = launch_commands(ZERO3, "accelerate", path, 16, 2)
    assert len(commands) == 2
    for rank, command in enumerate(commands):
        words = shlex.split(command)
        assert words[:2] == ["accelerate", "launch"]
        args = launch_command_parser().parse_args(words[2:])
        assert (args.config_file, args.machine_rank, args.main_process_ip) == (str(path), rank, MAIN_NODE)


def test_other_targets_launch_with_torchrun() -> None:
    from torch.distributed.run import get_args_parser

    for rank, command in enumerate(launch_commands(ZERO3, "deepspeed", "ds_config.json", 16, 2)):
        words = shlex.split(command)
        assert words[0] == "torchrun"
        args = get_args_parser().parse_args(words[1:])
        assert (args.nnodes, args.nproc_per_node, args.node_rank, args.master_addr) == ("2", "8", rank, MAIN_NODE)
    assert launch_commands(ZERO3, "accelerate", "a.yaml", 8, 1) == []  # one node: `accelerate launch` as usual


def test_cli_counts_gpus_per_node(tiny_model, cli) -> None:
    model = str(tiny_model("bert"))
    args = ["estimate", model, "--seq-len", "64", "--zero-stage", "3", "--bf16", "--gpu", "A100-80GB"]
    out = cli(*args, "--gpus", "4", "--nodes", "2", "--network", "infiniband-hdr", "--json")
    d = json.loads(out.stdout)
    assert (d["num_gpus"], d["nodes"], d["network"]) == (8, 2, "infiniband-hdr")
    text = " ".join(cli(*args, "--gpus", "4", "--nodes", "2").stdout.split())  # unwrapped
    assert "2 nodes x 4 x A100-80GB" in text and "InfiniBand NDR" in text


@pytest.mark.parametrize(("flags", "message"), [
    (["--nodes", "2"], "--nodes needs --gpus, the GPUs of one node"),
    (["--nodes", "0", "--gpus", "2"], "--nodes must be at least 1, got 0"),
    (["--nodes", "2", "--gpus", "2", "--network", "token-ring"], "--network: unknown network 'token-ring'; known: "),
    (["--gpus", "0"], "--gpus must be greater than 0, got 0"),
])
def test_bad_cluster_is_one_line_and_exit_2(flags, message, tiny_model, cli) -> None:
    out = cli("estimate", str(tiny_model("bert")), "--gpu", "A100-80GB", *flags)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_recipe_file_whose_processes_do_not_split_over_its_machines(tmp_path: Path, tiny_model, cli) -> None:
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "MULTI_GPU", "num_processes": 3, "num_machines": 2,
                                    "mixed_precision": "bf16"}))
    out = cli("estimate", str(tiny_model("bert")), "--gpu", "A100-80GB", "--recipe", str(path))
    assert out.returncode == 2 and "3 GPUs cannot be split evenly over 2 nodes" in out.stderr


def test_cluster_sizes_are_powers_of_two_on_a_node_then_whole_nodes() -> None:
    from anatomist.plan.clusters import cluster_sizes

    assert cluster_sizes(8, 3) == [(1, 1), (2, 1), (4, 1), (8, 1), (16, 2), (24, 3)]
    assert cluster_sizes(6, 1) == [(1, 1), (2, 1), (4, 1), (6, 1)]
    with pytest.raises(InputError, match="at least 1"):
        cluster_sizes(8, 0)


@pytest.mark.slow
def test_the_plan_chooses_the_cluster_with_the_most_samples_per_gpu(tiny) -> None:
    """Each size's pick is its plan's; a size the global batch does not split over is kept with its reason; the
    choice is the most samples/s per GPU, compared here with full plans' own figures, and it alone is planned."""
    from anatomist.plan.clusters import plan_clusters
    from anatomist.plan.search import fastest_fitting

    space = SearchSpace(global_batch_size=12, optims=("adamw_torch",), compile_options=(False,),
                        checkpointing_options=(False,), precisions=("bf16",))
    clusters, chosen = plan_clusters(space, [(1, 1), (2, 1), (4, 1), (8, 2)], lambda sized: plan(tiny, A100, space=sized),
                                     lambda sized: fastest_fitting(tiny, A100, space=sized))
    assert [(c.num_gpus, c.nodes, c.best is not None) for c in clusters] == [(1, 1, True), (2, 1, True), (4, 1, True),
                                                                             (8, 2, False)]
    assert "cannot be split evenly over 8 GPUs" in clusters[-1].why_not
    plans = {g: plan(tiny, A100, space=replace(space, num_gpus=g)) for g in (1, 2, 4)}
    per_gpu = {g: p.best.samples_per_second / g for g, p in plans.items()}
    assert chosen.samples_per_gpu == pytest.approx(max(per_gpu.values()), rel=0.01)
    assert [c.num_gpus for c in clusters if c.plan is not None] == [chosen.num_gpus]
    assert chosen.plan.to_dict() == plans[chosen.num_gpus].to_dict()
    assert chosen.to_dict()["fits"] and clusters[-1].to_dict()["recipe"] is None
    with pytest.raises(InputError, match="no cluster size has a recipe that fits"):
        plan_clusters(space, [(8, 2)], lambda sized: plan(tiny, A100, space=sized),
                      lambda sized: fastest_fitting(tiny, A100, space=sized))


def test_max_nodes_takes_no_nodes(cli) -> None:
    result = cli("plan", "gpt2", "--gpu", "A100-80GB", "--gpus", "8", "--nodes", "2", "--max-nodes", "2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["anatomist: error: --max-nodes chooses the number of nodes: leave --nodes out"]
