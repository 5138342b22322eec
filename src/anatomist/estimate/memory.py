"""Predict the memory anatomy of a training or inference step, offline.

From the estimator's traces (`traces.py`: the passes of each cut of the model's plan at 2 and 3
samples, the optimizer of each cut; for a uniform stack the cuts are 2 and 3 blocks), each phase's
allocation curve is extrapolated to the recipe's batch and to the full model (`curves.py`), sharded
over the devices (`sharding.py`); the peak phase is chosen after extrapolation, its categories are
the anatomy, and the largest batch that fits is a search over the same curves. The notes are
`memory_notes.py`'s. Tests check this against full-depth traces (test_extrapolation.py,
test_uneven_stacks.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN, Interval, MemoryAnatomy, MemoryCategory, Phase, Verdict
from anatomist.errors import InputError
from anatomist.estimate.curves import ExtrapolatedCurves
from anatomist.estimate.intervals import memory_interval
from anatomist.estimate.memory_notes import memory_notes
from anatomist.estimate.rules import BytesPerParamRule, bytes_per_param_rule
from anatomist.estimate.sharding import (
    ZeroSize,
    as_deepspeed_runs,
    counted_shares,
    persistent_bytes,
    persistent_parameters,
    shard,
    sharding_notes,
)
from anatomist.estimate.traces import Mode, StepTraces, step_traces
from anatomist.hardware import GPU
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.depth.plan import TracePlan
from anatomist.trace.engine.records import PhasePeak
from anatomist.trace.store import cache
from anatomist.trace.store.keys import Part, part_key
from anatomist.workload import Workload

MAX_BATCH_SEARCH = 1 << 16


@dataclass(kw_only=True, slots=True)
class MemoryEstimate:
    """The predicted memory of one step, and what it means for the GPU."""

    anatomy: MemoryAnatomy
    parameters: int
    trainable_parameters: int
    fits: bool
    max_batch_size: int
    """Largest per-device batch size whose predicted device_total fits within `limit_bytes` (0: none)."""
    limit_bytes: int
    """The GPU's memory less the margin kept free: what `fits` compares the device total with."""
    rule: BytesPerParamRule
    interval: Interval
    """The likely range of the device total (`intervals.memory_interval`: the errors of published GPU runs)."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Predicted peak allocated bytes of each phase."""
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> Verdict:
        """fits (even the top of the interval), borderline, or does not fit (even its bottom)."""
        return self.interval.verdict(self.limit_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory": self.anatomy_dict(),
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            "fits": self.fits,
            "verdict": self.verdict,
            "max_batch_size": self.max_batch_size,
            "limit_bytes": self.limit_bytes,
            "bytes_per_param_rule": asdict(self.rule),
            "phase_peaks": self.phase_peaks,
            "notes": self.notes,
        }

    def anatomy_dict(self) -> dict[str, Any]:
        """The anatomy's figures, with the device total's interval (`memory.interval` of the JSON)."""
        return {**self.anatomy.to_dict(), "interval": self.interval.to_dict()}


def memory_limit_bytes(gpu: GPU, margin: float) -> int:
    """The most a recipe's device total may be on `gpu` with `margin` of its memory kept free.

    Raises:
        InputError: a margin outside [0, 1).
    """
    if not 0 <= margin < 1:
        raise InputError(f"--memory-margin must be in [0, 1), got {margin}")
    return int(gpu.memory_bytes * (1 - margin))


def estimate_memory(
    workload: Workload, recipe: ResolvedRecipe, gpu: GPU, *, mode: Mode = "train", num_gpus: int = 1,
    margin: float = DEFAULT_MEMORY_MARGIN,
) -> MemoryEstimate:
    """Predict the memory anatomy of one step of `recipe` on `gpu`.

    Args:
        workload: model config, task and sequence length.
        recipe: the training knobs (batch size, precision, optimizer, ...).
        gpu: the target GPU (capacity, CUDA context size, cuBLAS workspace size).
        mode: "train" for a full optimizer step, "inference" for one forward pass.
        num_gpus: the data-parallel devices: an FSDP recipe is traced as one rank of that many
            (`trace.step.fsdp`); DeepSpeed ZeRO shards one device's trace across them (`sharding.py`).
        margin: share of the GPU's memory kept free when deciding `fits` and `max_batch_size`.

    Returns:
        A MemoryEstimate whose anatomy categories add up to device_total.
    """
    traces = step_traces(workload, recipe, gpu.compute_capability, mode, num_gpus=num_gpus)
    return memory_from_traces(workload, recipe, gpu, traces, mode=mode, num_gpus=num_gpus, margin=margin)


def memory_from_traces(
    workload: Workload, recipe: ResolvedRecipe, gpu: GPU, traces: StepTraces, *, mode: Mode = "train",
    num_gpus: int = 1, margin: float = DEFAULT_MEMORY_MARGIN,
) -> MemoryEstimate:
    """`estimate_memory` from the recipe's traces, `step_traces(workload, recipe, gpu.compute_capability, mode,
    num_gpus=num_gpus)`, where the caller has them (`estimate()`, the plan's evaluator)."""
    limit = memory_limit_bytes(gpu, margin)
    phases_at = _phase_peaks(workload, recipe, gpu, traces, mode, num_gpus)
    phases = phases_at(recipe.per_device_train_batch_size)
    anatomy = _anatomy(phases, gpu, num_gpus)
    assert anatomy.device_total is not None  # a prediction always has one
    parameters, trainable = traces.parameters, traces.trainable_parameters
    rule = bytes_per_param_rule(recipe, parameters, mode, trainable if recipe.peft != "none" else None)
    return MemoryEstimate(
        anatomy=anatomy,
        parameters=parameters,
        trainable_parameters=trainable,
        fits=anatomy.device_total <= limit,
        limit_bytes=limit,
        max_batch_size=_largest_batch(workload, recipe, gpu, mode, num_gpus, limit, phases_at),
        rule=rule,
        interval=memory_interval(anatomy.device_total, recipe, num_gpus),
        phase_peaks={str(p): v.allocated for p, v in phases.items()},
        notes=[*traces.notes, *memory_notes(workload, recipe, anatomy, rule, traces), *sharding_notes(recipe, num_gpus, mode),
               *_nccl_note(num_gpus)],
    )


class Moment(NamedTuple):
    """A place in one step of the full model, named as the traces name their points (`trace.engine.records.Event`)."""

    phase: Phase
    segment: str
    """"pre", "blocks" or "post" (`trace.engine.records.SEGMENTS`)."""
    micro_step: int
    """The micro-batch: 0, or 1 for the second (and later) of an accumulating step; 0 in the optimizer step."""
    block: int
    """In "blocks", the block's place among the full model's repeated blocks (from 0); else -1."""


def moment_peaks(
    workload: Workload, recipe: ResolvedRecipe, gpu: GPU, *, mode: Mode = "train", num_gpus: int = 1
) -> dict[Moment, PhasePeak]:
    """The highest point of each moment of one step, as `estimate_memory` predicts the step.

    The estimate's peak is the highest of them, with the same categories (`MemoryEstimate.anatomy`): this says
    where in the step it falls, so that a measurement can be read at the same moment (tests/test_fsdp_accuracy.py
    reads PyTorch's FSDPMemTracker there). It changes nothing the estimate reports.

    Known limitations: only the moments of the traced cuts are named. In the blocks those are the base cut's
    blocks, at their places in the full model (`_model_block`): for a uniform stack its first and last block, the
    blocks between being extrapolated into them.
    """
    traces = step_traces(workload, recipe, gpu.compute_capability, mode, num_gpus=num_gpus)
    model = ExtrapolatedCurves(traces)
    size = _zero_size(recipe, traces)
    moments = {}
    for phase in model.phases():
        for (_, segment, micro, block), peak in model.segment_peaks(phase, recipe.per_device_train_batch_size).items():
            moment = Moment(phase, segment, micro, _model_block(model.plan, block))
            moments[moment] = shard(peak, recipe, size, num_gpus, mode, phase)
    return moments


def _model_block(plan: TracePlan, block: int) -> int:
    """The place among the full model's blocks of the base cut's block `block` (-1 stays): each delta's added
    blocks that come before it in the delta's cut, as many times as the full model has them more, come before it
    in the full model."""
    if block < 0:
        return block
    return block + sum(d.multiplier * sum(1 for p in d.inserted if p < d.aligned(block)) for d in plan.deltas)


PhasePeaks = Callable[[int], dict[Phase, PhasePeak]]
"""The peak of each phase of the step at a per-device batch size, on one device of the sharding."""


def _phase_peaks(workload: Workload, recipe: ResolvedRecipe, gpu: GPU, traces: StepTraces, mode: Mode,
                 num_gpus: int) -> PhasePeaks:
    """Each phase's peak at any batch, extrapolated from `traces` and sharded over `num_gpus` devices."""
    model = ExtrapolatedCurves(traces)
    # The traces' keys name the model's peaks at any batch: recipes that share the traces share them.
    passes: Part = "forward-backward" if mode == "train" else "inference"
    run = as_deepspeed_runs(recipe)  # what was traced (`step_traces`)
    traced = (part_key(workload, run, passes, None, 0, gpu.compute_capability, num_gpus),
              part_key(workload, run, "optimizer", None, 1, gpu.compute_capability, num_gpus)
              if mode == "train" else None)

    size = _zero_size(recipe, traces)

    def peak_at(phase: Phase, b: int) -> PhasePeak:
        shares = counted_shares(recipe, size, num_gpus, mode, phase)
        return _PHASE_PEAKS.get((traced, shares, phase, b),
                                lambda: model.phase_at(phase, b, np.array(shares) if shares else None))

    def phases_at(b: int) -> dict[Phase, PhasePeak]:
        return {phase: shard(peak_at(phase, b), recipe, size, num_gpus, mode, phase) for phase in model.phases()}

    return phases_at


def _zero_size(recipe: ResolvedRecipe, traces: StepTraces) -> ZeroSize:
    """What the arithmetic of `sharding.shard` needs of the model (`traces.size`, the model as its step runs:
    `sharding.as_deepspeed_runs`): its parameters, the trainable ones' bytes as the step runs them (data parallelism's
    buckets, ZeRO's gradients) and, under ZeRO-3, the persistent ones and the largest block's."""
    model = traces.size
    size = ZeroSize(parameters=model.parameters, trainable=model.trainable_parameters,
                    trainable_bytes=model.trainable_bytes)
    if recipe.zero_stage < 3:
        return size
    threshold = recipe.stage3_param_persistence_threshold or 0
    element_bytes = model.parameter_bytes / max(model.parameters, 1)
    return dataclasses.replace(size, block=model.block_parameters, parameter_bytes=model.parameter_bytes,
                               persistent=persistent_parameters(model.parameter_numels, threshold),
                               persistent_bytes=persistent_bytes(model.parameter_numels, threshold, element_bytes))


NCCL_BYTES = {2: 544 * 2**20, 3: 688 * 2**20}
"""What NCCL holds on each GPU outside PyTorch's allocator once a process group of 2 (or of 3 and more) devices
has run a collective: 544 and 688 MB, measured through PyTorch on 4 x A100 with NVLink
(https://github.com/NVIDIA/nccl/issues/964).
NCCL's maintainers say it grows with the channels (more to reach an H100's NVLink bandwidth) and the GPUs, not
beyond two nodes
(https://github.com/NVIDIA/nccl/issues/986): the A100 figures stand for every GPU; a data-parallel step uses one communicator."""


def outside_allocator_bytes(gpu: GPU, num_gpus: int) -> int:
    """Device memory that no allocator statistic shows: the CUDA context and, on several devices, NCCL's buffers."""
    return gpu.cuda_context_bytes + (NCCL_BYTES[min(num_gpus, 3)] if num_gpus > 1 else 0)


def _anatomy(phases: dict[Phase, PhasePeak], gpu: GPU, num_gpus: int) -> MemoryAnatomy:
    """The categories at the highest phase peak; the allocator's reserve, the CUDA context and NCCL on top."""
    peak_phase = max(phases, key=lambda p: phases[p].allocated)
    peak = phases[peak_phase]
    peak_reserved = max(p.reserved for p in phases.values())
    device_total = peak_reserved + outside_allocator_bytes(gpu, num_gpus)
    return MemoryAnatomy(
        weights=peak.categories[MemoryCategory.WEIGHTS],
        optimizer_states=peak.categories[MemoryCategory.OPTIMIZER_STATES],
        gradients=peak.categories[MemoryCategory.GRADIENTS],
        activations=peak.categories[MemoryCategory.ACTIVATIONS],
        temporary=peak.categories[MemoryCategory.TEMPORARY],
        functionality=peak.categories[MemoryCategory.FUNCTIONALITY],
        runtime_overhead=device_total - peak.allocated,
        peak_allocated=peak.allocated,
        peak_reserved=peak_reserved,
        device_total=device_total,
        peak_phase=peak_phase,
    )


def _nccl_note(num_gpus: int) -> list[str]:
    """What NCCL's own buffers add to the runtime overhead on several devices (`memory.NCCL_BYTES`)."""
    if num_gpus < 2:
        return []
    nccl = NCCL_BYTES[min(num_gpus, 3)]
    return [f"runtime overhead: includes NCCL's own buffers, {nccl / 2**30:.2f} GiB per GPU (measured on A100s with "
            "NVLink, through PyTorch; more channels, as on H100, take more)"]


def _largest_batch(workload: Workload, recipe: ResolvedRecipe, gpu: GPU, mode: Mode, num_gpus: int, limit: int,
                   phases_at: PhasePeaks) -> int:
    """The largest per-device batch whose device total fits `limit`.

    It does not depend on the recipe's own batch: recipes that differ only in it (and in
    accumulation beyond the 2 micro-batches a trace runs) share the search."""

    def total_at(b: int) -> int:
        return max(p.reserved for p in phases_at(b).values()) + outside_allocator_bytes(gpu, num_gpus)

    shape = recipe.replace(per_device_train_batch_size=1, gradient_accumulation_steps=min(recipe.gradient_accumulation_steps, 2))
    key = (workload.trace_key(), shape, gpu.compute_capability, gpu.cuda_context_bytes, num_gpus, mode, limit)
    return _MAX_BATCH.get(key, lambda: _max_batch_size(total_at, limit))


_MAX_BATCH = cache.Memo(4096)
_PHASE_PEAKS = cache.Memo(8192)
"""PhasePeak by (traces, phase, batch); shared, so never changed after it is made (`shard` copies)."""


def _max_batch_size(total_at: Any, capacity: int) -> int:
    """Largest b with total_at(b) <= capacity; total_at is non-decreasing in b."""
    if total_at(1) > capacity:
        return 0
    lo, hi = 1, 2
    while hi <= MAX_BATCH_SEARCH and total_at(hi) <= capacity:
        lo, hi = hi, hi * 2
    if hi > MAX_BATCH_SEARCH:
        return MAX_BATCH_SEARCH
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if total_at(mid) <= capacity:
            lo = mid
        else:
            hi = mid
    return lo
