"""Predict the memory anatomy of a training or inference step, offline.

From the estimator's traces (`traces.py`: the passes of each cut of the model's plan at 2 and 3
samples, the optimizer of each cut; for a uniform stack the cuts are 2 and 3 blocks): within one
cut, the traces at the two batch sizes run the same ops, so their allocation curves are
extrapolated point by point to the wanted batch size; then segment by segment, and in the blocks
block by block, to the full model. The peak phase is chosen after extrapolation. Tests check
this against full-depth traces (test_extrapolation.py, test_uneven_stacks.py).

The caching allocator's reserve (rounding, cached free blocks) does not extrapolate block
by block; the ratio of peak reserved to peak allocated of the deepest, largest trace is
applied to the extrapolated peak instead (known limitation: at full depth, segment reuse
can make the real ratio a little smaller).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN, GIB, TENSOR_CATEGORIES, MemoryAnatomy, MemoryCategory, Phase
from anatomist.axes.liger import liger_note, liger_table
from anatomist.errors import InputError
from anatomist.estimate.intervals import Interval, Verdict, memory_interval
from anatomist.estimate.llm_notes import llm_notes
from anatomist.estimate.loss_peak import loss_peak_note
from anatomist.estimate.moe import moe_note
from anatomist.estimate.peft_notes import peft_notes
from anatomist.estimate.rules import BytesPerParamRule, bytes_per_param_rule
from anatomist.estimate.sharding import ModelSize, as_deepspeed_runs, persistent_parameters, shard, sharding_notes
from anatomist.estimate.traces import TRACE_BATCHES, Mode, StepTraces, affine, offloaded_bytes, step_traces
from anatomist.hardware import GPU
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.depth.cuts import Depth
from anatomist.trace.depth.plan import TracePlan, model_plan
from anatomist.trace.engine.records import Curves, PhasePeak
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


@dataclass(slots=True)
class _Model:
    """The traces of a plan's cuts at two batch sizes, and how to extrapolate them to the full model."""

    traces: StepTraces

    @property
    def plan(self) -> TracePlan:
        return self.traces.plan

    def state_bytes(self) -> int:
        optimizer = self.traces.optimizer
        if optimizer is None:
            return 0
        return round(self.plan.combine(lambda c: optimizer[c].static_bytes.get(MemoryCategory.OPTIMIZER_STATES, 0)))

    def phases(self) -> list[Phase]:
        phases = list(self.traces.passes[self.plan.base, TRACE_BATCHES[0]].phases)
        return phases + ([Phase.OPTIMIZER] if self.traces.optimizer else [])

    def phase_at(self, phase: Phase, batch: int) -> PhasePeak:
        """The peak of `phase` of the full model at `batch` samples per pass.

        Per cut, the batch-2 and batch-3 curves are extrapolated point by point to `batch`.
        Then, segment by segment (in the blocks, block by block: each block of the base with the
        same block of each other cut), the points of the base are matched with the same points of
        the other cuts and extrapolated point by point to the full model (`TracePlan.combine`);
        the peak is the highest point. Where a segment's points do not match up, its peaks are
        extrapolated instead.
        """
        points, ratio = self._points(phase, batch)
        best_allocated, best_categories = -1.0, None
        keys = [k for k in points[self.plan.base][0].index if k[0] is phase]
        for key in keys:
            allocated, categories = self._segment(points, key)
            i = int(np.argmax(allocated))
            if allocated[i] > best_allocated:
                best_allocated, best_categories = float(allocated[i]), categories[i]
        return self._peak(phase, best_allocated, best_categories, ratio)

    def segment_peaks(self, phase: Phase, batch: int) -> dict[tuple[Phase, str, int, int], PhasePeak]:
        """The highest point of each segment of `phase` (in the blocks, of each block of the base cut), on the
        full model at `batch` samples per pass: the points `phase_at` takes the highest of."""
        points, ratio = self._points(phase, batch)
        peaks = {}
        for key in [k for k in points[self.plan.base][0].index if k[0] is phase]:
            allocated, categories = self._segment(points, key)
            i = int(np.argmax(allocated))
            peaks[key] = self._peak(phase, float(allocated[i]), categories[i], ratio)
        return peaks

    def _points(self, phase: Phase, batch: int) -> tuple[dict[Depth, tuple[Curves, np.ndarray, np.ndarray]], float]:
        """Each cut's curve of `phase` at `batch` (its keys, allocated, categories), and the reserve ratio."""
        optimizer = self.traces.optimizer
        if phase is Phase.OPTIMIZER and optimizer is not None:
            points = {c: (optimizer[c].curves, optimizer[c].curves.allocated, optimizer[c].curves.categories)
                      for c in self.plan.cuts}
            return points, optimizer[self.plan.deepest].curves.reserve_ratio
        points = {c: self._at_batch(c, batch) for c in self.plan.cuts}
        return points, self.traces.passes[self.plan.deepest, TRACE_BATCHES[1]].curves.reserve_ratio

    def _peak(self, phase: Phase, allocated: float, categories: np.ndarray | None, ratio: float) -> PhasePeak:
        """A point of the full model's curve as a PhasePeak: the reserve and the optimizer states added."""
        peak = PhasePeak.from_vector(allocated, categories if categories is not None else [0.0] * len(TENSOR_CATEGORIES))
        # Fragmentation does not extrapolate block by block; its ratio to the peak does, roughly.
        peak.reserved = max(peak.allocated, round(peak.allocated * ratio))
        if phase is not Phase.OPTIMIZER:
            states = self.state_bytes()  # alive, unchanged, through forward and backward
            peak.categories[MemoryCategory.OPTIMIZER_STATES] += states
            peak.allocated += states
            peak.reserved += states
        return peak

    def _segment(
        self, points: dict[Depth, tuple[Curves, np.ndarray, np.ndarray]], key: tuple[Phase, str, int, int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The points of one segment (one block, in the blocks) of the base, extrapolated to the full model."""
        k0, a0, c0 = points[self.plan.base]
        i0 = k0.index[key]
        matched = []
        for delta in self.plan.deltas:
            curves, a, c = points[delta.cut]
            phase, segment, micro, block = key
            i = curves.index.get((phase, segment, micro, delta.aligned(block) if block >= 0 else block))
            matched.append((delta.multiplier, i, a, c))
        if all(i is not None and len(i) == len(i0) for _, i, _, _ in matched):
            allocated, categories = a0[i0].copy(), c0[i0].copy()
            for m, i, a, c in matched:
                allocated += m * (a[i] - a0[i0])
                categories += m * (c[i] - c0[i0])
            return allocated, categories
        # No point-wise match: extrapolate the segment's peak (a cut without the segment adds nothing).
        j0 = i0[np.argmax(a0[i0])]
        allocated, categories = a0[j0:j0 + 1].copy(), c0[j0:j0 + 1].copy()
        for m, i, a, c in matched:
            if i is not None and len(i):
                j = i[np.argmax(a[i])]
                allocated += m * (a[j] - a0[j0])
                categories += m * (c[j:j + 1] - c0[j0:j0 + 1])
        return allocated, categories

    def _at_batch(self, cut: Depth, batch: int) -> tuple[Curves, np.ndarray, np.ndarray]:
        """The cut's curve (its points' keys, allocated, categories) extrapolated to `batch` samples."""
        lo, hi = (self.traces.passes[cut, b].curves for b in TRACE_BATCHES)
        if lo.keys != hi.keys:
            raise RuntimeError(
                f"the traced op sequence changed between batch {TRACE_BATCHES[0]} and {TRACE_BATCHES[1]}; "
                "cannot extrapolate in batch size"
            )
        allocated = affine(lo.allocated, hi.allocated, batch, TRACE_BATCHES[0])
        categories = affine(lo.categories, hi.categories, batch, TRACE_BATCHES[0])
        return lo, allocated, categories


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
    limit = memory_limit_bytes(gpu, margin)
    traces = step_traces(workload, recipe, gpu.compute_capability, mode, num_gpus=num_gpus)
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
        notes=[*traces.notes, *_notes(workload, recipe, anatomy, rule, traces), *sharding_notes(recipe, num_gpus, mode),
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
    model = _Model(traces)
    size = _model_size(workload, recipe, traces)
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
    model = _Model(traces)
    # The traces' keys name the model's peaks at any batch: recipes that share the traces share them.
    passes: Part = "forward-backward" if mode == "train" else "inference"
    run = as_deepspeed_runs(recipe)  # what was traced (`step_traces`)
    traced = (part_key(workload, run, passes, None, 0, gpu.compute_capability, num_gpus),
              part_key(workload, run, "optimizer", None, 1, gpu.compute_capability, num_gpus)
              if mode == "train" else None)

    def peak_at(phase: Phase, b: int) -> PhasePeak:
        return _PHASE_PEAKS.get((traced, phase, b), lambda: model.phase_at(phase, b))

    size = _model_size(workload, recipe, traces)

    def phases_at(b: int) -> dict[Phase, PhasePeak]:
        return {phase: shard(peak_at(phase, b), recipe, size, num_gpus, mode, phase) for phase in model.phases()}

    return phases_at


def _model_size(workload: Workload, recipe: ResolvedRecipe, traces: StepTraces) -> ModelSize:
    """What the arithmetic of `sharding.shard` needs of the model: its parameters, the trainable ones' bytes as the
    step runs them (data parallelism's buckets, ZeRO's gradients) and, under ZeRO-3, the persistent ones and the
    largest block's."""
    plan = model_plan(workload, as_deepspeed_runs(recipe))
    size = ModelSize(parameters=traces.parameters, trainable=traces.trainable_parameters,
                     trainable_bytes=plan.trainable_bytes)
    if recipe.zero_stage < 3:
        return size
    threshold = recipe.stage3_param_persistence_threshold or 0
    return dataclasses.replace(size, block=plan.block_parameters,
                               persistent=persistent_parameters(plan.parameter_numels, threshold))


NCCL_BYTES = {2: 544 * 2**20, 3: 688 * 2**20}
"""What NCCL holds on each GPU outside PyTorch's allocator once a process group of 2 (or of 3 and more) devices
has run a collective: 544 and 688 MB, measured through PyTorch on 4 x A100 with NVLink (NVIDIA/nccl issue #964).
NCCL's maintainers say it grows with the channels (more to reach an H100's NVLink bandwidth) and the GPUs, not
beyond two nodes (NVIDIA/nccl issue #986): the A100 figures stand for every GPU; a data-parallel step uses one communicator."""


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


def _nccl_note(num_gpus: int) -> list[str]:
    if num_gpus < 2:
        return []
    nccl = NCCL_BYTES[min(num_gpus, 3)]
    return [f"runtime overhead: includes NCCL's own buffers, {nccl / 2**30:.2f} GiB per GPU (measured on A100s with "
            "NVLink, NVIDIA/nccl issue #964; more channels, as on H100, take more)"]


def _notes(workload: Workload, recipe: ResolvedRecipe, anatomy: MemoryAnatomy, rule: BytesPerParamRule,
           traces: StepTraces) -> list[str]:
    notes = [workload.config_note] if workload.config_note else []  # a catalog alias: which config stands in
    notes += rule.explain(anatomy, recipe)
    loss = loss_peak_note(workload, recipe, anatomy, traces)
    if loss is not None:
        notes.append(loss)
    if recipe.peft != "none":
        base = (f"{recipe.bnb_4bit_quant_type} 4-bit" if recipe.load_in_4bit else "int8" if recipe.load_in_8bit
                else recipe.dtype)
        notes.append(f"{recipe.peft}: the {base} base is frozen (no gradients, no optimizer states); the r={recipe.lora_r} "
                     "adapters (fp32, as PEFT makes them) carry the full rule")
    elif recipe.half_weights and recipe.fsdp != "none" and recipe.mixed_precision != "no":
        notes.append(  # trace/step/fsdp.py does what accelerate's fsdp2_prepare_model does
            f"weights loaded in {recipe.dtype}, but with {recipe.mixed_precision} mixed precision accelerate's FSDP2 "
            "upcasts the trainable parameters to fp32: fp32 sharded master weights, gradients and optimizer states, "
            f"the weights gathered in {recipe.mixed_precision} for compute"
        )
    elif recipe.half_weights:
        notes.append(
            f"weights loaded in {recipe.dtype}: pure {recipe.dtype} training (gradients and optimizer states "
            "in that dtype, no fp32 master weights); --dtype float32 gives the fp32 / mixed-precision figure"
        )
    if recipe.torch_compile:
        notes.append(  # trace/step/compiled.py
            "torch.compile: each block keeps for backward what AOTAutograd's min-cut partitioner (inductor's "
            "partition) saves, traced on fake tensors; inductor's kernels are approximated (its code generation "
            "is not run); embeddings, head and loss stay eager" + ("; with gradient checkpointing the blocks are "
            "predicted as eager checkpointed code (fusion's time saving not counted)" if recipe.gradient_checkpointing else "")
        )
    if recipe.attn_implementation == "flash_attention_2":
        notes.append("flash_attention_2: modelled as a fused kernel keeping output + log-sum-exp (as SDPA flash)")
    if recipe.activation_offloading:
        moved = offloaded_bytes(traces, recipe.per_device_train_batch_size)
        notes.append(  # trace/step/offload.py, estimate/communication.py activation_offloading_s
            f"activation offloading (TRL's): {moved / GIB:.2f} GiB of saved activations per micro-batch go to pinned "
            "host memory and back, by TRL's rules (1 KiB or more, not a parameter, not the output head's; the last 5 "
            "kept on the device while they copy); the copies are timed at an assumed PCIe rate (12 GB/s), hidden under the "
            "forward, not under the backward (which waits for each)")
    if recipe.use_liger_kernel and workload.config is not None:
        notes.append(_liger_note(workload, recipe))
    notes += llm_notes(workload, recipe)
    notes += peft_notes(workload, recipe, model_plan(workload, recipe))
    moe = moe_note(workload, recipe)
    if moe is not None:
        notes.append(moe)
    return notes


def _liger_note(workload: Workload, recipe: ResolvedRecipe) -> str:
    """Liger's fused cross-entropy: its chunk, and what the trace's chunk leaves out (axes/liger.py); under TRL's
    trainers, which keep Liger's layer kernels only, that."""
    if recipe.trainer != "trainer":
        return (f"Liger Kernel {liger_table().version}: stand-ins of its RMSNorm, SwiGLU and RoPE kernels allocate and "
                "save what Liger's own do; TRL turns its fused linear + cross-entropy off (it would replace TRL's own "
                "fused LM head: liger_kernel_config fused_linear_cross_entropy=False)")
    text = workload.config.get_text_config()
    half = recipe.mixed_precision != "no" or recipe.half_weights
    return liger_note(recipe.per_device_train_batch_size, workload.seq_len, int(text.hidden_size),
                      int(text.vocab_size), 2 if half else 4)
