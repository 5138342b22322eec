"""The host-device copies offload adds to a step, over PCIe: ZeRO-Offload's (or FSDP's CPU offload's) gradients,
weights and CPU Adam; offloaded checkpoints; TRL's activation offloading. Constants: data/plan_throughput.toml's
[offload]."""

from __future__ import annotations

import math

from anatomist.estimate.time.collectives import gathered_weight_bytes, parameter_count
from anatomist.estimate.time.constants import constants
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.depth.plan import ModelSize
from anatomist.workload import Workload


def offload_s(recipe: ResolvedRecipe, size: ModelSize, *, num_gpus: int = 1, nodes: int = 1) -> float:
    """Seconds per step of ZeRO-Offload's (or FSDP's CPU offload's) PCIe traffic and CPU Adam (0 without offload).
    Each GPU has its own PCIe link, but the GPUs of a node share its host's cores: the host steps the partitions of
    all of them (`cpu_adam_params_per_s` is a host's rate). Hugging Face's Ulysses post bears that out: one H100 and
    four with sequence parallel 4 train Qwen3-4B with the optimizer offloaded at nearly the same step time (26.9 and
    28.3 s: the host steps 4B parameters either way)."""
    if recipe.offload == "none":
        return 0.0
    c = constants()["offload"]
    params = parameter_count(recipe, size) / num_gpus  # offload needs ZeRO >= 2: each device owns 1/N
    up_bytes = 2 if recipe.mixed_precision != "no" else 4  # updated weights in the half precision, else fp32
    moved = params * (4 + up_bytes)
    if recipe.sharding_stage >= 3:  # the weights' shards are on the host: up before the forward and backward all-gathers
        moved += 2 * gathered_weight_bytes(recipe, size) / num_gpus
    on_the_host = params * max(num_gpus // max(nodes, 1), 1)
    return moved / (c["pcie_gbps"] * 1e9) + on_the_host / c["cpu_adam_params_per_s"]


def checkpoint_offload_s(workload: Workload, recipe: ResolvedRecipe, size: ModelSize) -> float:
    """Seconds per step of offloaded checkpoints (`Recipe.checkpoint_offload`): each checkpointed layer's input,
    tokens x hidden in the weights' dtype (transformers: "layers x sequence x hidden bytes"), goes to the host in
    forward and back in backward, over PCIe on the compute stream (so not hidden behind compute)."""
    if not (recipe.gradient_checkpointing and recipe.checkpoint_offload):
        return 0.0
    layers = math.ceil(size.blocks / recipe.checkpoint_every)
    element = 2 if recipe.half_weights else 4  # the residual stream: fp32 under autocast of fp32 weights
    tokens = recipe.per_device_train_batch_size * workload.seq_len * recipe.gradient_accumulation_steps
    return 2 * layers * tokens * workload.hidden_size() * element / (constants()["offload"]["pcie_gbps"] * 1e9)


def activation_offloading_s(recipe: ResolvedRecipe, micro_batch_bytes: float, forward_s: float) -> float:
    """Seconds per step that TRL's activation offloading (`Recipe.activation_offloading`) adds: what each micro-batch
    copies to the host (`micro_batch_bytes`: `traces.offloaded_bytes`, extrapolated as every traced figure) goes over PCIe on a
    side stream under the forward, which hides it up to the forward's compute; backward copies each tensor back
    only when its node needs it and waits for it (trl/models/activation_offloading.py: no prefetch), so the way
    back is not hidden."""
    if not recipe.activation_offloading:
        return 0.0
    one_way = micro_batch_bytes * recipe.gradient_accumulation_steps / (constants()["offload"]["pcie_gbps"] * 1e9)
    return max(0.0, one_way - forward_s) + one_way
