"""Predict the memory anatomy of a training or inference step, offline.

A step is traced (see `step.py`) on models cut to 1 and 2 blocks, at 1 and 2 samples per
pass. Every figure of a phase's peak is bilinear in depth and batch size (each block and
each sample adds the same tensors), so four small traces give the full model at any batch
size: f(L, B) = f11 + (L-1)·Δdepth + (B-1)·Δbatch + (L-1)(B-1)·Δboth. The peak phase is
chosen after extrapolation. A test checks this against a full-depth trace.

The caching allocator's reserve (rounding, cached free blocks) does not extrapolate block
by block; the ratio of peak reserved to peak allocated of the deepest, largest trace is
applied to the extrapolated peak instead (known limitation: at full depth, segment reuse
can make the real ratio a little smaller).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from anatomist.anatomy import TENSOR_CATEGORIES, MemoryAnatomy, MemoryCategory, Phase
from anatomist.estimate.rules import BytesPerParamRule, bytes_per_param_rule
from anatomist.estimate.sharding import shard
from anatomist.estimate.step import Mode, PhasePeak, StepTrace, num_layers, trace_step
from anatomist.hardware import GPU
from anatomist.recipe import Recipe
from anatomist.workload import Workload

MAX_BATCH_SEARCH = 1 << 16

# Recipe fields that change what a trace records (batch size and accumulation beyond 2 do not).
_TRACE_FIELDS = ("gradient_checkpointing", "fp16", "bf16", "optim", "attn_implementation", "max_grad_norm")
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


def _trace(workload: Workload, recipe: Recipe, depth: int, batch: int, gpu: GPU, mode: Mode) -> StepTrace:
    key = (
        workload.name,
        workload.task,
        workload.seq_len,
        workload.config.to_json_string(use_diff=False),
        tuple(getattr(recipe, f) for f in _TRACE_FIELDS),
        min(recipe.gradient_accumulation_steps, 2),
        depth,
        batch,
        gpu.compute_capability.split(".")[0] >= "9",
        mode,
    )
    if key not in _cache:
        _cache[key] = trace_step(
            workload, recipe, depth=depth, batch_size=batch, compute_capability=gpu.compute_capability, mode=mode
        )
    return _cache[key]


def _bilinear(f11: float, f21: float, f12: float, f22: float, depth: int, batch: int) -> float:
    both = f22 - f21 - f12 + f11
    return f11 + (depth - 1) * (f21 - f11) + (batch - 1) * (f12 - f11) + (depth - 1) * (batch - 1) * both


@dataclass(slots=True)
class _Model:
    """Per phase: the vector of figures at (depth, batch) in {1,2}²."""

    corners: dict[tuple[Phase, str], tuple[list[float], list[float], list[float], list[float]]]
    params: tuple[int, int]
    trainable: tuple[int, int]
    reserve_ratio: float
    """peak reserved / peak allocated of the deepest, largest trace (allocator rounding and cache)."""

    def phase_at(self, phase: Phase, depth: int, batch: int) -> PhasePeak:
        """The highest of the phase's segment peaks, each extrapolated on its own."""
        peaks = []
        for (p, _segment), (c11, c21, c12, c22) in self.corners.items():
            if p is phase:
                vector = [_bilinear(*v, depth, batch) for v in zip(c11, c21, c12, c22, strict=True)]
                peaks.append(PhasePeak.from_vector(vector))
        peak = max(peaks, key=lambda x: x.allocated)
        peak.reserved = max(peak.allocated, round(peak.allocated * self.reserve_ratio))
        return peak

    @property
    def phases(self) -> list[Phase]:
        return list(dict.fromkeys(p for p, _ in self.corners))


def _fit(workload: Workload, recipe: Recipe, gpu: GPU, mode: Mode) -> _Model:
    t = {(d, b): _trace(workload, recipe, d, b, gpu, mode) for d in (1, 2) for b in (1, 2)}
    corners = {
        key: (
            t[1, 1].phases[key].as_vector(),
            t[2, 1].phases[key].as_vector(),
            t[1, 2].phases[key].as_vector(),
            t[2, 2].phases[key].as_vector(),
        )
        for key in t[1, 1].phases
    }
    # Fragmentation does not extrapolate event by event; its ratio to the peak does, roughly.
    deepest = t[2, 2].phases.values()
    ratio = max(p.reserved for p in deepest) / max(max(p.allocated for p in deepest), 1)
    return _Model(
        corners,
        (t[1, 1].parameters, t[2, 1].parameters),
        (t[1, 1].trainable_parameters, t[2, 1].trainable_parameters),
        max(ratio, 1.0),
    )


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
    parameters = round(_bilinear(model.params[0], model.params[1], model.params[0], model.params[1], depth, 1))
    trainable = round(_bilinear(model.trainable[0], model.trainable[1], model.trainable[0], model.trainable[1], depth, 1))

    def phases_at(b: int) -> dict[Phase, PhasePeak]:
        return {
            phase: shard(model.phase_at(phase, depth, b), recipe, parameters, num_gpus, mode)
            for phase in model.phases
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
    assert sum(anatomy.category_bytes(c) for c in TENSOR_CATEGORIES) == peak.allocated  # internal invariant

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
