"""`estimate()`: the memory and time prediction of one recipe, as one result object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN
from anatomist.calibration.lookup import Calibration, calibration_for
from anatomist.errors import InputError
from anatomist.estimate.longest import LongestSequence
from anatomist.estimate.memory import MemoryEstimate, estimate_memory, memory_from_traces
from anatomist.estimate.moe import MoeRouting, moe_routing
from anatomist.estimate.time.cluster import adds_device_terms, time_across_devices
from anatomist.estimate.time.device import estimate_time
from anatomist.estimate.time.network import DEFAULT_NODES, check_cluster, cluster_fields
from anatomist.estimate.traces import Mode, offloaded_bytes, step_traces
from anatomist.hardware import GPU
from anatomist.recipe import Recipe, ResolvedRecipe
from anatomist.recipe.checks import check_gpu
from anatomist.recipe.parallel_checks import (
    check_context_parallel_gpus,
    check_expert_parallel_gpus,
    check_hybrid_shard_gpus,
    check_sequence_parallel_gpus,
    check_tensor_parallel_gpus,
)
from anatomist.workload import Workload


@dataclass(kw_only=True, slots=True)
class Estimate:
    """Everything `anatomist estimate` reports: one object, serialised as is by --json."""

    workload: Workload
    recipe: Recipe
    gpu: GPU
    mode: Mode
    margin: float
    """Share of the GPU's memory kept free when deciding what fits."""
    memory: MemoryEstimate
    time: Any | None = None
    """A TimeAnatomy once the time prediction exists for this recipe."""
    moe: MoeRouting | None = None
    """The routing a Mixture-of-Experts estimate assumes and its peak range (None for a dense model)."""
    extra: dict[str, Any] = field(default_factory=dict)
    num_gpus: int = 1
    """Data-parallel devices the step runs on (ZeRO/FSDP shard across them); the figures are per device."""
    nodes: int = 1
    """Machines those devices are spread over (only the time changes: collectives cross `network`)."""
    network: str | None = None
    """The network between the nodes (a name of `network.networks()`); None: one node, or the default."""
    longest: LongestSequence | None = None
    """Where the length was searched (`estimate --longest-seq-len`): what the search found, and how."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.workload.name,
            "task": self.workload.task,
            "seq_len": self.workload.seq_len,
            "mode": self.mode,
            "parameters": self.memory.parameters,
            "trainable_parameters": self.memory.trainable_parameters,
            "recipe": self.recipe.to_dict(),
            "gpu": {"name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes},
            "num_gpus": self.num_gpus,
            **cluster_fields(self.nodes, self.network),
            "memory": self.memory.anatomy_dict(),
            "fits": self.memory.fits,
            "verdict": self.memory.verdict,
            "memory_margin": self.margin,
            "limit_bytes": self.memory.limit_bytes,
            "max_batch_size": self.memory.max_batch_size,
            "bytes_per_param_rule": self.memory.to_dict()["bytes_per_param_rule"],
            "phase_peaks": self.memory.phase_peaks,
            "notes": self.memory.notes,
        }
        if self.longest is not None:
            out["longest_seq_len"] = self.longest.to_dict()
        if self.moe is not None:
            out["moe"] = self.moe.to_dict()
        if self.time is not None:
            out["time"] = self.time.to_dict()
        return out


def estimate(
    workload: Workload, recipe: Recipe, gpu: GPU, *, mode: Mode = "train", num_gpus: int = 1,
    calibration: Calibration | None = None, margin: float = DEFAULT_MEMORY_MARGIN,
    nodes: int = DEFAULT_NODES, network: str | None = None,
) -> Estimate:
    """Predict memory (and, in training, time) of one step of `recipe` on `gpu`; `calibration`:
    the time model's factors (default: `calibration_for(gpu)`, the lookup of calibration/lookup.py);
    `num_gpus` devices in all, on `nodes` machines joined by `network` (`network.networks()`).

    Raises:
        InputError: what `gpu` cannot run (`recipe.checks.check_gpu`: bfloat16 weights run, emulated, on any GPU),
            or what the model cannot take (`Recipe.resolved`).
    """
    check_cluster(num_gpus, nodes, network)
    check_tensor_parallel_gpus(recipe, num_gpus, nodes)
    check_hybrid_shard_gpus(recipe, num_gpus)
    check_expert_parallel_gpus(recipe, num_gpus)
    check_context_parallel_gpus(recipe, num_gpus, nodes)
    check_sequence_parallel_gpus(recipe, num_gpus, nodes)
    if mode == "inference" and recipe.sequence_parts > 1:
        raise InputError("context and sequence parallel split training steps (the Trainer evaluates without them: "
                         "DeepSpeed's Ulysses is disabled in eval, accelerate's ring hooks training): drop --cp-size / "
                         "--sp-size for --mode inference")
    check_gpu(recipe, gpu, dtype_given=False)
    recipe = recipe.resolved(workload)  # the library's entry point: everything below takes it resolved
    workload = workload.for_recipe(recipe)  # padding-free: the data's sequences, not the longest
    traces = step_traces(workload, recipe, gpu.compute_capability, mode, num_gpus=num_gpus)  # read once, handed down
    memory = memory_from_traces(workload, recipe, gpu, traces, mode=mode, num_gpus=num_gpus, margin=margin)

    def other_end(routed: ResolvedRecipe) -> int:  # expert parallel's range: the peak at the other routing
        return estimate_memory(workload, routed, gpu, mode=mode, num_gpus=num_gpus).anatomy.peak_allocated

    calibration = calibration or calibration_for(gpu)
    time = None
    if mode == "train":  # the plan's time model: one device's step, plus sharding, offload and communication terms
        # TRL's activation offloading is refused under FSDP: these are the traces `predict_time` would read
        offloaded = offloaded_bytes(traces, recipe.per_device_train_batch_size) if recipe.activation_offloading else 0.0
        time = (time_across_devices(workload, recipe, gpu, traces.size, micro_batch_offload_bytes=offloaded,
                                    num_gpus=num_gpus, calibration=calibration, nodes=nodes, network=network)
                if adds_device_terms(recipe, num_gpus) else estimate_time(workload, recipe, gpu, calibration))
    return Estimate(workload=workload, recipe=recipe, gpu=gpu, mode=mode, margin=margin, memory=memory, time=time,
                    moe=moe_routing(workload, recipe, memory.anatomy, other_end), extra={"time_calibration": calibration.describe()},
                    num_gpus=num_gpus, nodes=nodes, network=network)
