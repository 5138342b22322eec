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
    communication_s             what of the collectives compute does not hide (`Collectives`,
                                `exposed_s`)

The collectives, in (N-1)/N x bytes per ring, at the bus bandwidth (`bus_bytes_per_s`: across nodes the
slower of the intra-node bus and the network):

    DDP                 all-reduce of the gradients, 2x their bytes, on the last micro-batch (no_sync
                        before), in 25 MiB buckets while the backward runs (bucket_cap_mb)
    ZeRO-1              the same volume, after the last backward: reduce-scatter of the gradients, then
                        all-gather of the updated weights after the optimizer step
    ZeRO-2              reduce-scatter on every micro-batch (DeepSpeed keeps only its partition of the
                        gradients), in reduce_bucket_size buckets under the backward (overlap_comm, as
                        `plan --emit deepspeed` writes it), all-gather of the updated weights after the step
    ZeRO-3, FSDP        every weight (a frozen base's too) all-gathered before each micro-batch's forward
    full_shard          and again before its backward, unit by unit (a block, and the root), the next
                        unit's prefetched while one computes; reduce-scatter per unit under the backward,
                        on every micro-batch (DeepSpeed) or the last (FSDP's no_sync)
    FSDP shard_grad_op  as full_shard without the backward all-gather (the weights stay whole from
                        forward to backward)

A phase takes max(compute, its collectives) plus what cannot overlap: the first unit's all-gather (nothing
computes before it) and the last reduction (its gradients exist only when the backward ends: the last
unit's, or the last bucket). Rajbhandari et al. 2020 (ZeRO, sec. 7): ZeRO-3 moves 1.5x the all-reduce's
volume; Zhao et al. 2023 (PyTorch FSDP, sec. 3.3-3.4): the backward prefetch and the overlap of the
reduce-scatter with the backward. Checked against llm-foundry's published MPT runs on 16 to 512 GPUs
(docs/time.md, "Beyond one node").

Their constants live in data/plan_throughput.toml with their sources; none was measured.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Protocol

from anatomist.anatomy import TimeAnatomy
from anatomist.errors import InputError
from anatomist.estimate.calibration import Calibration, calibration_for
from anatomist.estimate.intervals import time_interval
from anatomist.estimate.sharding import overlap_comm
from anatomist.estimate.time import estimate_time
from anatomist.hardware import GPU
from anatomist.recipe import Recipe, ResolvedRecipe
from anatomist.workload import Workload

DEFAULT_NODES = 1
UNFITTED_TERMS = ("the sharding, offload and communication terms are not in that error (plan_throughput.toml's "
                  "constants, not fitted; on llm-foundry's runs on 16-512 GPUs: 3.6% median, docs/time.md)")
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
    return num_gpus > 1 or recipe.offload != "none" or recipe.checkpoint_offload or recipe.activation_offloading


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


def describe_network(num_gpus: int, nodes: int, network: str | None, gpu: GPU | None = None) -> str:
    """One line for the output: the network between the nodes and the bandwidth the time model gives it."""
    name = network or default_network()
    return (f"{nodes} nodes, {networks()[name]['describe']} ({name}): collectives at "
            f"{bus_bytes_per_s(num_gpus, nodes, name, gpu) / 1e9:.0f} GB/s bus bandwidth")


def intra_node_bytes_per_s(gpu: GPU | None) -> float:
    """The achieved bus bandwidth among `gpu`s of one host, by how they are joined (`GPU.interconnect`)."""
    interconnect = constants()["interconnect"]
    kind = interconnect["kinds"].get(gpu.interconnect) if gpu is not None else None
    return (kind or interconnect)["bus_gbps"] * 1e9


def bus_bytes_per_s(
    num_gpus: int, nodes: int = DEFAULT_NODES, network: str | None = None, gpu: GPU | None = None
) -> float:
    """Achieved bus bandwidth of a data-parallel collective over `num_gpus` `gpu`s on `nodes` machines.

    In one node: what the GPUs' interconnect achieves (None: the catalog's default). Across nodes NCCL runs a
    ring per NIC, so the ring's slowest hop moves at the node's network bandwidth (all its NICs) times what
    NCCL achieves of it.
    """
    intra = intra_node_bytes_per_s(gpu)
    if nodes <= 1:
        return intra
    link = networks()[network or default_network()]
    node_gbit = link["gbit_per_gpu"] * (num_gpus // nodes) if "gbit_per_gpu" in link else link["gbit_per_node"]
    return min(intra, node_gbit / 8 * 1e9 * constants()["inter_node"]["achieved"])


def parameter_count(workload: Workload, recipe: ResolvedRecipe) -> int:
    """The parameters `recipe` trains (the estimator's exact count, `trace.depth.plan.model_plan`): every
    parameter of the task model, or with LoRA/QLoRA the adapters', as PEFT makes them."""
    from anatomist.trace.depth.plan import model_plan

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
    from anatomist.trace.depth.plan import model_plan

    layers = math.ceil(model_plan(workload, recipe).blocks / recipe.checkpoint_every)
    element = 2 if recipe.half_weights else 4  # the residual stream: fp32 under autocast of fp32 weights
    tokens = recipe.per_device_train_batch_size * workload.seq_len * recipe.gradient_accumulation_steps
    return 2 * layers * tokens * workload.hidden_size() * element / (constants()["offload"]["pcie_gbps"] * 1e9)


def activation_offloading_s(workload: Workload, recipe: ResolvedRecipe, gpu: GPU, forward_s: float) -> float:
    """Seconds per step that TRL's activation offloading (`Recipe.activation_offloading`) adds: what each micro-batch
    copies to the host (`records.StepTrace.offloaded_bytes`, extrapolated as every traced figure) goes over PCIe on a
    side stream under the forward, which hides it up to the forward's compute; backward copies each tensor back
    only when its node needs it and waits for it (trl/models/activation_offloading.py: no prefetch), so the way
    back is not hidden."""
    if not recipe.activation_offloading:
        return 0.0
    from anatomist.estimate.traces import offloaded_bytes, step_traces

    traces = step_traces(workload, recipe, gpu.compute_capability)
    one_way = offloaded_bytes(traces, recipe.per_device_train_batch_size) * recipe.gradient_accumulation_steps / (
        constants()["offload"]["pcie_gbps"] * 1e9)
    return max(0.0, one_way - forward_s) + one_way


DDP_BUCKET_BYTES = 25 * 2**20
"""DistributedDataParallel's default bucket_cap_mb (25 MiB), which the Trainer leaves as it is."""


@dataclass(frozen=True, slots=True)
class Collectives:
    """One device's collectives in one optimizer step, as seconds at the bus bandwidth, and when they run."""

    micro_batches: int
    gather_forward_s: float = 0.0
    """All-gather of the weights before each micro-batch's forward (ZeRO-3, FSDP)."""
    gather_backward_s: float = 0.0
    """And before its backward (ZeRO-3, FSDP full_shard)."""
    reduce_s: float = 0.0
    """Gradient reduction of one reducing micro-batch."""
    reduces_every_micro_batch: bool = False
    """DeepSpeed ZeRO-2/3 reduce each micro-batch's gradients; DDP and FSDP only the last's (no_sync)."""
    reduce_overlapped: bool = True
    """Whether the reduction runs while the backward computes (ZeRO-1 reduces after it)."""
    reduce_tail_s: float = 0.0
    """What of a reduction starts only when the backward ends: the last bucket or unit."""
    units: int = 1
    """Units gathered one after another (blocks and the root): the first one's gather is not hidden."""
    after_step_s: float = 0.0
    """ZeRO-1/2's all-gather of the updated weights after the optimizer step."""

    def total_s(self) -> float:
        """Every collective of the step, hidden or not."""
        reductions = self.micro_batches if self.reduces_every_micro_batch else 1
        return (self.micro_batches * (self.gather_forward_s + self.gather_backward_s) + reductions * self.reduce_s
                + self.after_step_s)

    def exposed_s(self, forward_s: float, backward_s: float) -> float:
        """What of them the device waits for, given the step's forward and backward compute (all micro-batches)."""
        k = self.micro_batches
        forward, backward = forward_s / k, backward_s / k
        exposed = k * _phase_exposed_s(self.gather_forward_s, 0.0, forward, self.units)
        for micro in range(k):
            reduce = self.reduce_s if self.reduces_every_micro_batch or micro == k - 1 else 0.0
            if self.reduce_overlapped:
                tail = self.reduce_tail_s if reduce else 0.0
                exposed += _phase_exposed_s(self.gather_backward_s, reduce, backward, self.units) + tail
            else:
                exposed += _phase_exposed_s(self.gather_backward_s, 0.0, backward, self.units) + reduce
        return exposed + self.after_step_s


def _phase_exposed_s(gather_s: float, reduce_s: float, compute_s: float, units: int) -> float:
    """A phase's collectives beyond its compute, plus its first unit's all-gather, which nothing hides."""
    return max(gather_s + reduce_s - compute_s, 0.0) + gather_s / units


def collectives(
    workload: Workload, recipe: ResolvedRecipe, *, num_gpus: int = 1, nodes: int = DEFAULT_NODES,
    network: str | None = None, gpu: GPU | None = None,
) -> Collectives:
    """The collectives of one optimizer step of `recipe` on `num_gpus` devices (module docstring)."""
    k = recipe.gradient_accumulation_steps
    if num_gpus <= 1:
        return Collectives(micro_batches=k)
    from anatomist.trace.depth.plan import model_plan

    bus = bus_bytes_per_s(num_gpus, nodes, network, gpu)
    ring = (num_gpus - 1) / num_gpus
    # PEFT makes adapters in fp32 whatever the base's dtype. Full fine-tuning reduces gradients in the weights'
    # dtype: half weights' own; under autocast of fp32 weights DDP's are fp32, while DeepSpeed keeps the model in
    # the half dtype and FSDP's MixedPrecisionPolicy reduces in it.
    sharded = recipe.zero_stage > 0 or recipe.fsdp != "none"
    half = recipe.peft == "none" and (recipe.half_weights or (recipe.mixed_precision != "no" and sharded))
    element = 2 if half else 4
    grad_bytes = parameter_count(workload, recipe) * element
    reduce_scatter = ring * grad_bytes / bus
    if recipe.sharding_stage >= 3 or recipe.fsdp == "shard_grad_op":
        gather = ring * gathered_weight_bytes(workload, recipe) / bus
        units = model_plan(workload, recipe).blocks + 1
        return Collectives(micro_batches=k, gather_forward_s=gather,
                           gather_backward_s=gather if recipe.sharding_stage >= 3 else 0.0,
                           reduce_s=reduce_scatter, reduces_every_micro_batch=recipe.zero_stage >= 2,
                           reduce_tail_s=reduce_scatter / units, units=units)
    if recipe.zero_stage == 0:  # DDP
        return Collectives(micro_batches=k, reduce_s=2 * reduce_scatter,
                           reduce_tail_s=2 * reduce_scatter * min(1.0, DDP_BUCKET_BYTES / grad_bytes))
    bucket = recipe.reduce_bucket_size * element if recipe.reduce_bucket_size else grad_bytes
    return Collectives(micro_batches=k, reduce_s=reduce_scatter, reduces_every_micro_batch=recipe.zero_stage >= 2,
                       reduce_overlapped=overlap_comm(recipe), reduce_tail_s=reduce_scatter * min(1.0, bucket / grad_bytes),
                       after_step_s=reduce_scatter)


def communication_s(
    workload: Workload, recipe: ResolvedRecipe, *, num_gpus: int = 1, nodes: int = DEFAULT_NODES,
    network: str | None = None, gpu: GPU | None = None,
) -> float:
    """Seconds per step of every collective of `recipe` over `num_gpus` `gpu`s on `nodes` machines joined by
    `network` (a name of `networks()`; None: the default), hidden behind compute or not."""
    return collectives(workload, recipe, num_gpus=num_gpus, nodes=nodes, network=network, gpu=gpu).total_s()


def gathered_weight_bytes(workload: Workload, recipe: ResolvedRecipe) -> float:
    """Bytes of one all-gather of the whole model under ZeRO-3 / FSDP full_shard: a quantized base's codes as
    they are stored (bitsandbytes' FSDP-QLoRA guide stores them in a float dtype: the same bytes), every
    other parameter in the dtype it is gathered in (the half dtype under mixed precision or half weights)."""
    from anatomist.trace.depth.plan import model_plan

    plan = model_plan(workload, recipe)
    element = 2 if recipe.mixed_precision != "no" or recipe.half_weights else 4
    return plan.quantized_codes + (sum(plan.parameter_numels) - plan.quantized_codes) * element


def predict_time(
    workload: Workload, recipe: ResolvedRecipe, gpu: GPU, *, num_gpus: int = 1, calibration: Calibration | None = None,
    nodes: int = DEFAULT_NODES, network: str | None = None,
) -> TimeAnatomy:
    """One optimizer step of `recipe` on `num_gpus` data-parallel devices, spread over `nodes`
    machines joined by `network` (module docstring)."""
    calibration = calibration or calibration_for(gpu)
    one = estimate_time(workload, recipe, gpu, calibration)
    phases = dict(one.phases_s)
    if recipe.offload != "none":
        phases["optimizer"] = 0.0
    elif recipe.sharding_stage >= 1:
        phases["optimizer"] = phases.get("optimizer", 0.0) / num_gpus
    phases["offload"] = (offload_s(workload, recipe, num_gpus=num_gpus) + checkpoint_offload_s(workload, recipe)
                         + activation_offloading_s(workload, recipe, gpu, phases.get("forward", 0.0)))
    comm = collectives(workload, recipe, num_gpus=num_gpus, nodes=nodes, network=network, gpu=gpu)
    phases["communication"] = comm.exposed_s(phases.get("forward", 0.0), phases.get("backward", 0.0))
    step_s = sum(phases.values())
    # The optimizer step, the copies and the collectives are all "other" (docs/time.md), so the classes add up to
    # the step as its phases do.
    classes = dict(one.classes_s)
    added = phases.get("optimizer", 0.0) - one.phases_s.get("optimizer", 0.0) + phases["offload"] + phases["communication"]
    classes["other"] = classes.get("other", 0.0) + added
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
        hidden_communication_s=comm.total_s() - phases["communication"],
        classes_s=classes,
        calibrated=one.calibrated,
        calibration=one.calibration,
        error_median_pct=one.error_median_pct,
        error_worst_pct=one.error_worst_pct,
        interval=time_interval(step_s, calibration, recipe, num_gpus, nodes),
    )
