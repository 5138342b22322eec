"""The multi-device step time: one device's step (estimate/time.py) plus what sharding, offload and
communication change. Both `estimate` and `plan` call `predict_time`, so one recipe on N devices has
one step time.

`anatomist.estimate.time.estimate_time` (a roofline per traced op, factors from
`estimate.calibration.calibration_for`) predicts one device running the whole step. Across devices and
with DeepSpeed or FSDP three terms change:

    optimizer_s  / N            when optimizer state is sharded (ZeRO >= 1, FSDP): each device
                                updates its 1/N of the parameters
    offload_s                   ZeRO-Offload replaces the GPU optimizer step: fp32 gradients go
                                to the host, updated weights come back over PCIe, and DeepSpeed's
                                CPU Adam updates 1/N of the parameters; where the parameters live
                                on the host too (ZeRO-3 offload_param, FSDP's CPUOffloadPolicy),
                                each device copies its shard of every weight to the device before
                                each all-gather, in forward and in backward; offloaded checkpoints
                                copy each checkpointed layer's input to the host and back
    communication_s             ring all-reduce of the gradients, 2 (N-1)/N x gradient bytes;
                                ZeRO-3 / FSDP full_shard reduce-scatter the gradients, (N-1)/N x
                                their bytes, and all-gather every weight (a frozen base's too) in
                                forward and backward, 2 (N-1)/N x the gathered bytes: for full
                                fine-tuning 1.5x the all-reduce (Rajbhandari et al. 2020, sec. 7);
                                no overlap with compute; across nodes at the slower of the
                                intra-node bus and the network (`bus_bytes_per_s`)

Their constants live in data/plan_throughput.toml with their sources; none was measured.
"""

from __future__ import annotations

import math
import tomllib
from functools import cache
from importlib import resources
from typing import Any, Protocol

from anatomist.anatomy import TimeAnatomy
from anatomist.errors import InputError
from anatomist.estimate.calibration import Calibration
from anatomist.estimate.time import estimate_time
from anatomist.hardware import GPU
from anatomist.recipe import Recipe, ResolvedRecipe
from anatomist.workload import Workload

DEFAULT_NODES = 1
UNFITTED_TERMS = ("the sharding, offload and communication terms are not in that error (plan_throughput.toml's "
                  "constants, not fitted)")
"""What a calibrated time's error leaves out once a step has more than one device or offloads."""


class TimeModel(Protocol):
    """Predicts the time of one optimizer step of `recipe` on `num_gpus` devices of `gpu` on `nodes` machines."""

    def __call__(
        self, workload: Workload, recipe: ResolvedRecipe, gpu: GPU, *, num_gpus: int = 1, nodes: int = DEFAULT_NODES,
        network: str | None = None,
    ) -> TimeAnatomy: ...


@cache
def constants() -> dict[str, Any]:
    return tomllib.loads(resources.files("anatomist.data").joinpath("plan_throughput.toml").read_text())


def adds_device_terms(recipe: Recipe, num_gpus: int) -> bool:
    """Whether `predict_time` adds anything to one device's step: sharding, offload or communication terms,
    which the calibration's error does not cover (UNFITTED_TERMS)."""
    return num_gpus > 1 or recipe.offload != "none" or recipe.checkpoint_offload


def networks() -> dict[str, dict[str, Any]]:
    """The networks between nodes that `--network` names (plan_throughput.toml's [inter_node.networks])."""
    return constants()["inter_node"]["networks"]


def default_network() -> str:
    return constants()["inter_node"]["default"]


def check_cluster(num_gpus: int, nodes: int, network: str | None) -> None:
    """Refuse a node count that does not divide the devices, or a network the catalog lacks."""
    if nodes < 1:
        raise InputError(f"--nodes must be at least 1, got {nodes}")
    if num_gpus % nodes:
        raise InputError(f"{num_gpus} GPUs cannot be split evenly over {nodes} nodes")
    if network is not None and network not in networks():
        raise InputError(f"--network: unknown network {network!r}; known: {', '.join(networks())}")


def cluster_fields(nodes: int, network: str | None) -> dict[str, Any]:
    """What a result's JSON says of the machines: nothing on one node (the output 0.x scripts read)."""
    if nodes <= 1:
        return {}
    return {"nodes": nodes, "network": network or default_network()}


def describe_network(num_gpus: int, nodes: int, network: str | None) -> str:
    """One line for the output: the network between the nodes and the bandwidth the time model gives it."""
    name = network or default_network()
    return (f"{nodes} nodes, {networks()[name]['describe']} ({name}): collectives at "
            f"{bus_bytes_per_s(num_gpus, nodes, name) / 1e9:.0f} GB/s bus bandwidth")


def bus_bytes_per_s(num_gpus: int, nodes: int = DEFAULT_NODES, network: str | None = None) -> float:
    """Achieved bus bandwidth of a data-parallel collective over `num_gpus` devices on `nodes` machines.

    In one node: the intra-node assumption. Across nodes NCCL runs a ring per NIC, so the ring's
    slowest hop moves at the node's network bandwidth (all its NICs) times what NCCL achieves of it.
    """
    intra = constants()["interconnect"]["bus_gbps"] * 1e9
    if nodes <= 1:
        return intra
    link = networks()[network or default_network()]
    node_gbit = link["gbit_per_gpu"] * (num_gpus // nodes) if "gbit_per_gpu" in link else link["gbit_per_node"]
    return min(intra, node_gbit / 8 * 1e9 * constants()["inter_node"]["achieved"])


def parameter_count(workload: Workload, recipe: ResolvedRecipe) -> int:
    """The parameters `recipe` trains (the estimator's exact count, `trace.cuts.model_plan`): every
    parameter of the task model, or with LoRA/QLoRA the adapters', as PEFT makes them."""
    from anatomist.trace.cuts import model_plan

    plan = model_plan(workload, recipe)
    return plan.trainable_parameters if recipe.peft != "none" else plan.parameters


def offload_s(workload: Workload, recipe: ResolvedRecipe, *, num_gpus: int = 1) -> float:
    """Seconds per step of ZeRO-Offload's (or FSDP's CPU offload's) PCIe traffic and CPU Adam (0 without offload)."""
    if recipe.offload == "none":
        return 0.0
    c = constants()["offload"]
    params = parameter_count(workload, recipe) / num_gpus  # offload needs ZeRO >= 2: each device owns 1/N
    up_bytes = 2 if recipe.mixed_precision != "no" else 4  # updated weights in the half precision, else fp32
    moved = params * (4 + up_bytes)
    if recipe.sharding_stage >= 3:  # the weights' shards are on the host: up before the forward and backward all-gathers
        moved += 2 * gathered_weight_bytes(workload, recipe) / num_gpus
    return moved / (c["pcie_gbps"] * 1e9) + params / c["cpu_adam_params_per_s"]


def checkpoint_offload_s(workload: Workload, recipe: ResolvedRecipe) -> float:
    """Seconds per step of offloaded checkpoints (`Recipe.checkpoint_offload`): each checkpointed layer's input,
    tokens x hidden in the weights' dtype (transformers: "layers x sequence x hidden bytes"), goes to the host in
    forward and back in backward, over PCIe on the compute stream (so not hidden behind compute)."""
    if not (recipe.gradient_checkpointing and recipe.checkpoint_offload):
        return 0.0
    from anatomist.trace.cuts import model_plan

    layers = math.ceil(model_plan(workload, recipe).blocks / recipe.checkpoint_every)
    element = 2 if recipe.half_weights else 4  # the residual stream: fp32 under autocast of fp32 weights
    tokens = recipe.per_device_train_batch_size * workload.seq_len * recipe.gradient_accumulation_steps
    return 2 * layers * tokens * workload.hidden_size() * element / (constants()["offload"]["pcie_gbps"] * 1e9)


def communication_s(
    workload: Workload, recipe: ResolvedRecipe, *, num_gpus: int = 1, nodes: int = DEFAULT_NODES, network: str | None = None
) -> float:
    """Seconds per step of gradient all-reduce (and ZeRO-3 / full_shard weight all-gather) over
    `num_gpus` devices on `nodes` machines joined by `network` (a name of `networks()`; None: the default)."""
    if num_gpus <= 1:
        return 0.0
    ring = (num_gpus - 1) / num_gpus
    # PEFT makes adapters in fp32 whatever the base's dtype; full fine-tuning reduces half-precision gradients
    # under mixed precision (DDP's and FSDP's reduce dtype) and with half weights (their own dtype).
    half = recipe.peft == "none" and (recipe.mixed_precision != "no" or recipe.half_weights)
    grad_bytes = parameter_count(workload, recipe) * (2 if half else 4)
    if recipe.sharding_stage < 3:
        volume = 2 * ring * grad_bytes  # ring all-reduce
    else:  # reduce-scatter of the gradients, all-gather of every weight (frozen base included) in forward and backward
        volume = ring * (grad_bytes + 2 * gathered_weight_bytes(workload, recipe))
    return volume / bus_bytes_per_s(num_gpus, nodes, network)


def gathered_weight_bytes(workload: Workload, recipe: ResolvedRecipe) -> float:
    """Bytes of one all-gather of the whole model under ZeRO-3 / FSDP full_shard: a quantized base's codes as
    they are stored (bitsandbytes' FSDP-QLoRA guide stores them in a float dtype: the same bytes), every
    other parameter in the dtype it is gathered in (the half dtype under mixed precision or half weights)."""
    from anatomist.trace.cuts import model_plan

    plan = model_plan(workload, recipe)
    element = 2 if recipe.mixed_precision != "no" or recipe.half_weights else 4
    return plan.quantized_codes + (sum(plan.parameter_numels) - plan.quantized_codes) * element


def predict_time(
    workload: Workload, recipe: ResolvedRecipe, gpu: GPU, *, num_gpus: int = 1, calibration: Calibration | None = None,
    nodes: int = DEFAULT_NODES, network: str | None = None,
) -> TimeAnatomy:
    """One optimizer step of `recipe` on `num_gpus` data-parallel devices, spread over `nodes`
    machines joined by `network` (module docstring)."""
    one = estimate_time(workload, recipe, gpu, calibration)
    phases = dict(one.phases_s)
    if recipe.offload != "none":
        phases["optimizer"] = 0.0
    elif recipe.sharding_stage >= 1:
        phases["optimizer"] = phases.get("optimizer", 0.0) / num_gpus
    phases["offload"] = offload_s(workload, recipe, num_gpus=num_gpus) + checkpoint_offload_s(workload, recipe)
    phases["communication"] = communication_s(workload, recipe, num_gpus=num_gpus, nodes=nodes, network=network)
    step_s = sum(phases.values())
    samples = recipe.per_device_train_batch_size * recipe.gradient_accumulation_steps * num_gpus
    return TimeAnatomy(
        step_s=step_s,
        samples_per_second=samples / step_s,
        tokens_per_second=samples * workload.seq_len / step_s,
        flops_per_step=one.flops_per_step * num_gpus,
        hardware_flops_per_step=one.hardware_flops_per_step * num_gpus,
        mfu=one.mfu * one.step_s / step_s,
        hfu=one.hfu * one.step_s / step_s,
        phases_s=phases,
        classes_s=one.classes_s,
        calibrated=one.calibrated,
        calibration=one.calibration,
        error_median_pct=one.error_median_pct,
        error_worst_pct=one.error_worst_pct,
    )
