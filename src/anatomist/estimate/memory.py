"""Predict the memory anatomy of a training or inference step, offline.

A step is traced (see `step.py`) in two parts, forward/backward and optimizer, on models
cut to 2 and 3 blocks (the first block differs from the rest: it reads the embeddings), at 2 and 3 samples per pass. Every figure of a segment's peak is
affine in depth and batch size (each block and each sample adds the same tensors), so four
small traces give the full model at any batch size. The peak phase is
chosen after extrapolation. A test checks this against a full-depth trace.

Within one depth, the traces at batch 1 and 2 run the same ops, so their allocation
curves are extrapolated point by point to the wanted batch size before the peak is taken.

The caching allocator's reserve (rounding, cached free blocks) does not extrapolate block
by block; the ratio of peak reserved to peak allocated of the deepest, largest trace is
applied to the extrapolated peak instead (known limitation: at full depth, segment reuse
can make the real ratio a little smaller).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from anatomist.anatomy import TENSOR_CATEGORIES, MemoryAnatomy, MemoryCategory, Phase
from anatomist.estimate.cuda_model import cublas_workspace_bytes
from anatomist.estimate.rules import BytesPerParamRule, bytes_per_param_rule
from anatomist.estimate.sharding import shard
from anatomist.estimate.step import Curves, Mode, Part, PhasePeak, StepTrace, num_layers, trace_step
from anatomist.hardware import GPU
from anatomist.recipe import Recipe
from anatomist.workload import Workload

MAX_BATCH_SEARCH = 1 << 16

# Recipe fields that change each part's trace (batch size and accumulation beyond 2 do not).
_PART_FIELDS = {
    "forward-backward": ("gradient_checkpointing", "fp16", "bf16", "attn_implementation"),
    "inference": ("fp16", "bf16", "attn_implementation"),
    "optimizer": ("optim", "fp16", "max_grad_norm"),
}
_cache: dict[tuple[Any, ...], StepTrace] = {}


@dataclass(kw_only=True, slots=True)
class MemoryEstimate:
    """The predicted memory of one step, and what it means for the GPU."""

    anatomy: MemoryAnatomy
    parameters: int
    trainable_parameters: int
    fits: bool
    max_batch_size: int
    """Largest per-device batch size whose predicted device_total fits the GPU (0: none)."""
    rule: BytesPerParamRule
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Predicted peak allocated bytes of each phase."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory": self.anatomy.to_dict(),
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            "fits": self.fits,
            "max_batch_size": self.max_batch_size,
            "bytes_per_param_rule": asdict(self.rule),
            "phase_peaks": self.phase_peaks,
            "notes": self.notes,
        }


def _trace(workload: Workload, recipe: Recipe, depth: int, batch: int, gpu: GPU, part: Part) -> StepTrace:
    key = (
        *workload.trace_key(),
        part,
        tuple(getattr(recipe, f) for f in _PART_FIELDS[part]),
        min(recipe.gradient_accumulation_steps, 2) if part == "forward-backward" else 1,
        depth,
        batch if part != "optimizer" else 1,
        cublas_workspace_bytes(gpu.compute_capability),
    )
    if key not in _cache:
        _cache[key] = trace_step(
            workload, recipe, depth=depth, batch_size=batch, compute_capability=gpu.compute_capability, part=part
        )
    return _cache[key]


TRACE_DEPTHS = (2, 3)
TRACE_BATCHES = (2, 3)
"""Batch sizes of the traces: not 1, where size-1 dimensions make some copies views, so the
op sequence (and the curve) differs from every larger batch."""


def _affine(f_lo: float, f_hi: float, x: int, lo: int) -> float:
    """The value at x of the line through (lo, f_lo) and (lo + 1, f_hi)."""
    return f_lo + (x - lo) * (f_hi - f_lo)


@dataclass(slots=True)
class _Model:
    """Traces at depth and batch in {1, 2}, and how to extrapolate them to the full model."""

    passes: dict[tuple[int, int], StepTrace]
    """The forward/backward (or inference) traces."""
    optimizer: dict[int, StepTrace] | None
    """The optimizer traces by depth; None in inference."""

    def _linear(self, f1: float, f2: float, depth: int) -> float:
        return _affine(f1, f2, depth, TRACE_DEPTHS[0])

    def parameters(self, depth: int, trainable: bool = False) -> int:
        t1, t2 = (self.passes[d, TRACE_BATCHES[0]] for d in TRACE_DEPTHS)
        if trainable:
            return round(self._linear(t1.trainable_parameters, t2.trainable_parameters, depth))
        return round(self._linear(t1.parameters, t2.parameters, depth))

    def state_bytes(self, depth: int) -> int:
        if self.optimizer is None:
            return 0
        f1, f2 = (self.optimizer[d].static_bytes.get(MemoryCategory.OPTIMIZER_STATES, 0) for d in TRACE_DEPTHS)
        return round(self._linear(f1, f2, depth))

    def phases(self) -> list[Phase]:
        phases = list(dict.fromkeys(p for p, _ in self.passes[TRACE_DEPTHS[0], TRACE_BATCHES[0]].phases))
        return phases + ([Phase.OPTIMIZER] if self.optimizer else [])

    def phase_at(self, phase: Phase, depth: int, batch: int) -> PhasePeak:
        """The peak of `phase` at `depth` blocks and `batch` samples per pass.

        Per depth, the batch-2 and batch-3 curves are extrapolated point by point to `batch`.
        Then, segment by segment, the points of the 1-block trace are matched with the same
        points of the 2-block trace (for the blocks segment: with its first and with its
        last block) and extrapolated point by point to `depth`; the peak is the highest
        point. Where a segment's points do not match up, its peaks are extrapolated instead.
        """
        if phase is Phase.OPTIMIZER and self.optimizer is not None:
            curves = {d: self.optimizer[d].curves for d in TRACE_DEPTHS}
            points = {d: (c, c.allocated, c.categories) for d, c in curves.items()}
            ratio = curves[TRACE_DEPTHS[1]].reserve_ratio
        else:
            points = {d: self._at_batch(d, batch) for d in TRACE_DEPTHS}
            ratio = self.passes[TRACE_DEPTHS[1], TRACE_BATCHES[1]].curves.reserve_ratio
        best_allocated, best_categories = -1.0, None
        keys = [k for k in points[TRACE_DEPTHS[0]][0].index if k[0] is phase]
        for key in keys:
            for allocated, categories in self._segment_at_depth(points, key, depth):
                i = int(np.argmax(allocated))
                if allocated[i] > best_allocated:
                    best_allocated, best_categories = float(allocated[i]), categories[i]
        peak = PhasePeak.from_vector([best_allocated, 0.0, *(best_categories if best_categories is not None else [0.0] * len(TENSOR_CATEGORIES))])
        # Fragmentation does not extrapolate block by block; its ratio to the peak does, roughly.
        peak.reserved = max(peak.allocated, round(peak.allocated * ratio))
        if phase is not Phase.OPTIMIZER:
            states = self.state_bytes(depth)  # alive, unchanged, through forward and backward
            peak.categories[MemoryCategory.OPTIMIZER_STATES] += states
            peak.allocated += states
            peak.reserved += states
        return peak

    def _segment_at_depth(
        self, points: dict[int, tuple[Curves, np.ndarray, np.ndarray]], key: tuple[Phase, str, int], depth: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        lo_d, hi_d = TRACE_DEPTHS
        (k1, a1, c1), (k2, a2, c2) = points[lo_d], points[hi_d]
        empty = np.empty(0, dtype=np.int64)
        i1, i2 = k1.index.get(key, empty), k2.index.get(key, empty)
        if len(i1) == 0 or len(i2) == 0:
            return []
        if len(i1) == len(i2):
            alignments = [i2]
        elif key[1] == "blocks" and len(i2) > len(i1):
            alignments = [i2[: len(i1)], i2[-len(i1):]]
        else:  # no point-wise match: extrapolate the segment peaks
            j1, j2 = i1[np.argmax(a1[i1])], i2[np.argmax(a2[i2])]
            return [(
                np.array([_affine(a1[j1], a2[j2], depth, lo_d)]),
                _affine(c1[j1], c2[j2], depth, lo_d)[None, :],
            )]
        return [
            (_affine(a1[i1], a2[j], depth, lo_d), _affine(c1[i1], c2[j], depth, lo_d)) for j in alignments
        ]

    def _at_batch(self, depth: int, batch: int) -> tuple[Curves, np.ndarray, np.ndarray]:
        """The depth's curve (its points' keys, allocated, categories) extrapolated to `batch` samples."""
        lo, hi = (self.passes[depth, b].curves for b in TRACE_BATCHES)
        if lo.keys != hi.keys:
            raise RuntimeError(
                f"the traced op sequence changed between batch {TRACE_BATCHES[0]} and {TRACE_BATCHES[1]}; "
                "cannot extrapolate in batch size"
            )
        allocated = _affine(lo.allocated, hi.allocated, batch, TRACE_BATCHES[0])
        categories = _affine(lo.categories, hi.categories, batch, TRACE_BATCHES[0])
        return lo, allocated, categories


def _fit(workload: Workload, recipe: Recipe, gpu: GPU, mode: Mode) -> _Model:
    part: Part = "forward-backward" if mode == "train" else "inference"
    passes = {(d, b): _trace(workload, recipe, d, b, gpu, part) for d in TRACE_DEPTHS for b in TRACE_BATCHES}
    optimizer = {d: _trace(workload, recipe, d, 1, gpu, "optimizer") for d in TRACE_DEPTHS} if mode == "train" else None
    return _Model(passes, optimizer)


def estimate_memory(
    workload: Workload, recipe: Recipe, gpu: GPU, *, mode: Mode = "train", num_gpus: int = 1
) -> MemoryEstimate:
    """Predict the memory anatomy of one step of `recipe` on `gpu`.

    Args:
        workload: model config, task and sequence length.
        recipe: the training knobs (batch size, precision, optimizer, ...).
        gpu: the target GPU (capacity, CUDA context size, cuBLAS workspace size).
        mode: "train" for a full optimizer step, "inference" for one forward pass.
        num_gpus: devices that DeepSpeed ZeRO shards across (1: no sharding).

    Returns:
        A MemoryEstimate whose anatomy categories add up to device_total.
    """
    model = _fit(workload, recipe, gpu, mode)
    depth = num_layers(workload)
    batch = recipe.per_device_train_batch_size
    parameters = model.parameters(depth)
    trainable = model.parameters(depth, trainable=True)

    def phases_at(b: int) -> dict[Phase, PhasePeak]:
        return {
            phase: shard(model.phase_at(phase, depth, b), recipe, parameters, num_gpus, mode, phase)
            for phase in model.phases()
        }

    phases = phases_at(batch)
    peak_phase = max(phases, key=lambda p: phases[p].allocated)
    peak = phases[peak_phase]
    peak_reserved = max(p.reserved for p in phases.values())
    device_total = peak_reserved + gpu.cuda_context_bytes
    anatomy = MemoryAnatomy(
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

    def total_at(b: int) -> int:
        return max(p.reserved for p in phases_at(b).values()) + gpu.cuda_context_bytes

    max_batch = _max_batch_size(total_at, gpu.memory_bytes)
    rule = bytes_per_param_rule(recipe, parameters, mode)
    return MemoryEstimate(
        anatomy=anatomy,
        parameters=parameters,
        trainable_parameters=trainable,
        fits=device_total <= gpu.memory_bytes,
        max_batch_size=max_batch,
        rule=rule,
        phase_peaks={str(p): v.allocated for p, v in phases.items()},
        notes=_notes(workload, recipe, anatomy, rule),
    )


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


def _notes(workload: Workload, recipe: Recipe, anatomy: MemoryAnatomy, rule: BytesPerParamRule) -> list[str]:
    notes = list(rule.explain(anatomy))
    if recipe.torch_compile:
        notes.append(
            "torch.compile: traced as eager code; inductor fuses element-wise ops and usually keeps "
            "less for backward, so activations are an upper bound"
        )
    if recipe.attn_implementation == "flash_attention_2":
        notes.append("flash_attention_2: modelled as a fused kernel keeping output + log-sum-exp (as SDPA flash)")
    if workload.is_moe:
        notes.append("Mixture of Experts: all experts' weights are kept; activations follow the router's real choice")
    return notes
