"""The multi-device step time: one device's step (estimate/time/device.py) plus what sharding, offload and
communication change. `plan` calls `predict_time`, `estimate()` its body `time_across_devices` with the model's
size it has read already: one recipe on N devices has one step time.

`anatomist.estimate.time.device.estimate_time` (a roofline per traced op, factors from
`calibration.lookup.calibration_for`) predicts one device running the whole step. Across devices and
with DeepSpeed or FSDP three terms change:

    optimizer_s  / N            when optimizer state is sharded (ZeRO >= 1, FSDP): each device
                                updates its 1/N of the parameters
    offload_s                   ZeRO-Offload replaces the GPU optimizer step: fp32 gradients go
                                to the host, updated weights come back over PCIe, and DeepSpeed's
                                CPU Adam updates 1/N of the parameters per GPU, a node's GPUs
                                sharing its host's cores; where the parameters live
                                on the host too (ZeRO-3 offload_param, FSDP's CPUOffloadPolicy),
                                each device copies its shard of every weight to the device before
                                each all-gather, in forward and in backward; offloaded checkpoints
                                copy each checkpointed layer's input to the host and back
    communication_s             what of the collectives compute does not hide (`Collectives`,
                                `exposed_s`), and tensor, expert, context and sequence parallel's,
                                none hidden (`tensor_parallel_s`, `expert_parallel_s`,
                                `context_parallel_s`, `sequence_parallel_s`)

Under tensor parallel "one device" is one rank of a group (its shards of each product: the traced ops of
`keys.one_device`), and a group of `tp_size` devices trains one batch: samples/s counts GPUs / tp_size of them. So
under context parallel: a rank computes its part of each sequence (S / cp_size tokens, its share of the ring's
attention), a group of `cp_size` trains one batch; and under DeepSpeed's sequence parallel (S / sp_size tokens, the
whole sequence's attention for 1 / sp_size of the heads), a group of `sp_size`.

The collectives are `collectives.py`'s, the copies of offload `transfers.py`'s, the bandwidth between the devices
`network.py`'s; their constants live in data/plan_throughput.toml with their sources; none was measured.
"""

from __future__ import annotations

from typing import Protocol

from anatomist.anatomy import TimeAnatomy
from anatomist.calibration.lookup import Calibration, calibration_for
from anatomist.estimate.intervals import time_interval
from anatomist.estimate.time.collectives import (
    collectives,
    context_parallel_s,
    expert_parallel_s,
    sequence_parallel_s,
    tensor_parallel_s,
)
from anatomist.estimate.time.device import estimate_time
from anatomist.estimate.time.network import DEFAULT_NODES
from anatomist.estimate.time.ops import step_ops
from anatomist.estimate.time.transfers import activation_offloading_s, checkpoint_offload_s, offload_s
from anatomist.estimate.traces import offloaded_bytes, step_traces
from anatomist.hardware import GPU
from anatomist.recipe import Recipe, ResolvedRecipe
from anatomist.trace.depth.plan import ModelSize, model_plan
from anatomist.workload import Workload

UNFITTED_TERMS = ("the sharding, offload and communication terms are not in that error (plan_throughput.toml's "
                  "constants, not fitted; on llm-foundry's runs on 16-512 GPUs: 3.6% median, docs/time.md)")
"""What a calibrated time's error leaves out once a step has more than one device or offloads."""


class TimeModel(Protocol):
    """Predicts the time of one optimizer step of `recipe` on `num_gpus` devices of `gpu` on `nodes` machines."""

    def __call__(
        self, workload: Workload, recipe: ResolvedRecipe, gpu: GPU, *, num_gpus: int = 1, nodes: int = DEFAULT_NODES,
        network: str | None = None,
    ) -> TimeAnatomy: ...


def adds_device_terms(recipe: Recipe, num_gpus: int) -> bool:
    """Whether `predict_time` adds anything to one device's step: sharding, offload or communication terms,
    which the calibration's error does not cover (UNFITTED_TERMS)."""
    return num_gpus > 1 or recipe.offload != "none" or recipe.checkpoint_offload or recipe.activation_offloading


def predict_time(
    workload: Workload, recipe: ResolvedRecipe, gpu: GPU, *, num_gpus: int = 1, calibration: Calibration | None = None,
    nodes: int = DEFAULT_NODES, network: str | None = None,
) -> TimeAnatomy:
    """One optimizer step of `recipe` on `num_gpus` data-parallel devices, spread over `nodes`
    machines joined by `network` (module docstring): the library's entry point, which reads the model's size and,
    under TRL's activation offloading, what its traces copy (`estimate()` hands both down to `time_across_devices`)."""
    size = model_plan(workload, recipe).size
    offloaded = 0.0
    if recipe.activation_offloading:
        traces = step_traces(workload, recipe, gpu.compute_capability)
        offloaded = offloaded_bytes(traces, recipe.per_device_train_batch_size)
    return time_across_devices(workload, recipe, gpu, size, micro_batch_offload_bytes=offloaded, num_gpus=num_gpus,
                               calibration=calibration, nodes=nodes, network=network)


def _sharded_share(recipe: ResolvedRecipe, size: ModelSize, num_gpus: int) -> float:
    """What of one device's optimizer step a device runs where the state is sharded over `num_gpus`: 1/N of every
    parameter. Under expert parallel one device's step (`keys.one_device`) already holds 1/ep_size of the experts."""
    if recipe.ep_size == 1 or not size.parameters:
        return 1 / num_gpus
    traced = size.parameters - size.expert_parameters + size.expert_parameters / recipe.ep_size
    return size.parameters / num_gpus / traced


def time_across_devices(
    workload: Workload, recipe: ResolvedRecipe, gpu: GPU, size: ModelSize, *, micro_batch_offload_bytes: float = 0.0,
    num_gpus: int = 1, calibration: Calibration | None = None, nodes: int = DEFAULT_NODES, network: str | None = None,
) -> TimeAnatomy:
    """`predict_time` of a model of `size` whose micro-batch copies `micro_batch_offload_bytes` to the host (TRL's activation
    offloading; `traces.offloaded_bytes`)."""
    calibration = calibration or calibration_for(gpu)
    one = estimate_time(workload, recipe, gpu, calibration)
    phases = dict(one.phases_s)
    if recipe.offload != "none":
        phases["optimizer"] = 0.0
    elif recipe.sharding_stage >= 1:
        phases["optimizer"] = phases.get("optimizer", 0.0) * _sharded_share(recipe, size, num_gpus)
    phases["offload"] = (offload_s(recipe, size, num_gpus=num_gpus, nodes=nodes) + checkpoint_offload_s(workload, recipe, size)
                         + activation_offloading_s(recipe, micro_batch_offload_bytes, phases.get("forward", 0.0)))
    comm = collectives(recipe, size, num_gpus=num_gpus, nodes=nodes, network=network, gpu=gpu)
    split = recipe.split_by_transformers or recipe.sequence_parts > 1
    ops = step_ops(workload, recipe, gpu.compute_capability) if split else None
    tp_s = (tensor_parallel_s(ops, recipe, gpu) + expert_parallel_s(ops, recipe, num_gpus, nodes, network, gpu)
            + context_parallel_s(ops, recipe, gpu) + sequence_parallel_s(ops, recipe, gpu) if ops is not None else 0.0)
    phases["communication"] = comm.exposed_s(phases.get("forward", 0.0), phases.get("backward", 0.0)) + tp_s
    step_s = sum(phases.values())
    # The optimizer step, the copies and the collectives are all "other" (docs/time.md), so the classes add up to
    # the step as its phases do.
    classes = dict(one.classes_s)
    added = phases.get("optimizer", 0.0) - one.phases_s.get("optimizer", 0.0) + phases["offload"] + phases["communication"]
    classes["other"] = classes.get("other", 0.0) + added
    groups = num_gpus // (recipe.tp_size * recipe.sequence_parts)  # the GPUs of a tensor, context, sequence parallel group: one batch
    samples = recipe.per_device_train_batch_size * recipe.gradient_accumulation_steps * groups
    return TimeAnatomy(
        step_s=step_s,
        samples_per_second=samples / step_s,
        tokens_per_second=samples * workload.seq_len / step_s,
        flops_per_step=one.flops_per_step * num_gpus,
        hardware_flops_per_step=one.hardware_flops_per_step * num_gpus,
        mfu=one.mfu * one.step_s / step_s,
        hfu=one.hfu * one.step_s / step_s,
        phases_s=phases,
        hidden_communication_s=comm.total_s() + tp_s - phases["communication"],
        classes_s=classes,
        calibrated=one.calibrated,
        calibration=one.calibration,
        error_median_pct=one.error_median_pct,
        error_worst_pct=one.error_worst_pct,
        interval=time_interval(step_s, calibration, recipe, num_gpus, nodes),
    )
