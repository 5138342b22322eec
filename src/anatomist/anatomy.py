"""The result types shared by prediction and measurement.

One `MemoryCategory` enum is used by the estimator (fake-tensor trace) and by the
measurer (real runs), so the two line up category by category, as PyTorch's
`torch.distributed._tools.mem_tracker` does with PARAM/GRAD/ACT/TEMP/OPT.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

GIB = 2**30
MIB = 2**20
"""Binary units: memory figures are printed in GiB and MiB, as nvidia-smi and PyTorch count."""

DEFAULT_MEMORY_MARGIN = 0.10
"""Share of the GPU's memory kept free when deciding whether a recipe fits (`estimate` and
`plan` alike, `--memory-margin`): the allocator's fragmentation varies run to run and the
prediction has an error (see the benchmark tables)."""


Verdict = Literal["fits", "borderline", "does not fit"]
"""Whether a step fits the GPU, its interval's top and bottom against the limit (`Interval.verdict`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """The likely range of a predicted figure, and what it rests on."""

    low: float
    high: float
    validated: bool
    """Whether runs of the prediction's own regime measured it (else another regime's runs stand in)."""
    basis: str
    """What the range was measured on, in words."""

    def to_dict(self) -> dict[str, Any]:
        return {"low": self.low, "high": self.high, "validated": self.validated, "basis": self.basis}

    def relative(self, predicted: float) -> tuple[float, float]:
        """The range as fractions of `predicted` (-0.1, +0.15: 10% below to 15% above)."""
        return self.low / predicted - 1, self.high / predicted - 1

    def verdict(self, limit: float) -> Verdict:
        if self.high <= limit:
            return "fits"
        return "does not fit" if self.low > limit else "borderline"


class MemoryCategory(enum.StrEnum):
    """The six components of the seeds' "Anatomy of Model's Memory", plus the runtime's own."""

    WEIGHTS = "weights"
    OPTIMIZER_STATES = "optimizer_states"
    GRADIENTS = "gradients"
    ACTIVATIONS = "activations"
    TEMPORARY = "temporary"
    FUNCTIONALITY = "functionality"
    RUNTIME_OVERHEAD = "runtime_overhead"

    @property
    def label(self) -> str:
        """The component's name in tables and charts (the guide's name, where a newcomer can read it)."""
        return _CATEGORY_LABELS[self]

    @property
    def description(self) -> str:
        """What the component holds, in a sentence (the page's tooltip, the docs)."""
        return _CATEGORY_DESCRIPTIONS[self]


_CATEGORY_LABELS = {
    MemoryCategory.WEIGHTS: "model weights",
    MemoryCategory.OPTIMIZER_STATES: "optimizer states",
    MemoryCategory.GRADIENTS: "gradients",
    MemoryCategory.ACTIVATIONS: "forward activations",
    MemoryCategory.TEMPORARY: "temporary buffers",
    MemoryCategory.FUNCTIONALITY: "feature buffers",
    MemoryCategory.RUNTIME_OVERHEAD: "runtime overhead",
}
_CATEGORY_DESCRIPTIONS = {
    MemoryCategory.WEIGHTS: "the model's parameters (and their half-precision copies under autocast)",
    MemoryCategory.OPTIMIZER_STATES: "what the optimizer keeps per parameter: AdamW's two moments, fp32 master weights",
    MemoryCategory.GRADIENTS: "one gradient per trained parameter",
    MemoryCategory.ACTIVATIONS: "what the forward pass keeps for backward (less with gradient checkpointing)",
    MemoryCategory.TEMPORARY: "short-lived tensors of one operation (a matmul's output before it is added, the loss's "
                              "logits)",
    MemoryCategory.FUNCTIONALITY: "buffers a feature in use keeps: cuBLAS's workspace, the fp16 loss scaler, DDP's "
                                  "gradient buckets, ZeRO's and FSDP's communication buffers (the guide's "
                                  "\"functionality-specific memory\")",
    MemoryCategory.RUNTIME_OVERHEAD: "the CUDA context and the caching allocator's reserve beyond the live tensors",
}


# Categories that live in the caching allocator (everything but the CUDA context).
TENSOR_CATEGORIES: tuple[MemoryCategory, ...] = tuple(
    c for c in MemoryCategory if c is not MemoryCategory.RUNTIME_OVERHEAD
)


class Phase(enum.StrEnum):
    """Where in a training step an event happens."""

    SETUP = "setup"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


STEP_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
"""The phases of a training step (SETUP is what exists before it starts)."""


class OpClass(enum.StrEnum):
    """The seeds' three operation classes, plus everything else."""

    CONTRACTION = "contraction"
    NORMALIZATION = "normalization"
    ELEMENTWISE = "elementwise"
    OTHER = "other"


@dataclass(kw_only=True, slots=True)
class MemoryAnatomy:
    """Bytes per category at the step's peak, the peak itself and when it happens.

    The six tensor categories are the bytes live *at the moment of the peak*, so they add up
    to `peak_allocated`. `runtime_overhead` is what the device holds beyond that: the CUDA
    context plus the caching allocator's rounding and cached-but-free blocks, so that all
    seven categories add up to `device_total` (what nvidia-smi shows).

    The same type holds a prediction (`anatomist.estimate`) and a measurement
    (`anatomist.measure`: bench rows, the Trainer callback, `track()`). A measurement on the
    CPU has no caching allocator and no CUDA context: `runtime_overhead`, `peak_reserved`
    and `device_total` are None there; a prediction always has them.
    """

    weights: int
    """Parameters and buffers (and, under mixed precision, the half-precision weight copies)."""
    optimizer_states: int
    """Optimizer state tensors (AdamW's two moments, Adafactor's factors, 8-bit blocks...)."""
    gradients: int
    """`.grad` of every trainable parameter."""
    activations: int
    """Tensors created in forward and kept alive for backward (inputs included)."""
    temporary: int
    """Everything else live at the peak: intermediate results freed once used."""
    functionality: int
    """Feature-specific memory: library workspaces (cuBLAS), loss-scaler state, KV cache."""
    runtime_overhead: int | None
    """CUDA context (outside the allocator) + allocator reserve (peak_reserved - peak_allocated)."""
    peak_allocated: int
    """Live tensor bytes at the peak (what torch.cuda.max_memory_allocated reports)."""
    peak_reserved: int | None
    """Bytes the caching allocator holds at the peak (torch.cuda.max_memory_reserved)."""
    device_total: int | None
    """What nvidia-smi would show: peak_reserved + runtime_overhead."""
    peak_phase: Phase
    """The phase of the step in which the peak happens."""

    def category_bytes(self, category: MemoryCategory) -> int:
        """Bytes of `category` (0 where a measurement has no figure for it)."""
        return int(getattr(self, category.value) or 0)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["peak_phase"] = str(self.peak_phase)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryAnatomy:
        return cls(**{**data, "peak_phase": Phase(data["peak_phase"])})


@dataclass(kw_only=True, slots=True, frozen=True)
class StepFlops:
    """Floating-point operations of one optimizer step (2 per multiply-add), counted two ways.

    The split of PaLM (Chowdhery et al. 2022, appendix B): model FLOPs utilisation (MFU)
    counts only what the model's math needs, so that a recipe cannot raise it by doing more
    work; hardware FLOPs utilisation (HFU) also counts the forward that gradient
    checkpointing recomputes in backward. Without checkpointing the two are equal.
    """

    model: int
    """Forward + backward of every micro-batch, without recomputation, + the optimizer step."""
    hardware: int
    """`model` + the forward recomputed in backward under gradient checkpointing."""

    def utilization(self, step_s: float, peak_flops: float) -> tuple[float, float]:
        """(MFU, HFU) of a step of `step_s` seconds on a device of `peak_flops` FLOP/s."""
        return self.model / step_s / peak_flops, self.hardware / step_s / peak_flops


@dataclass(kw_only=True, slots=True)
class TimeAnatomy:
    """Where the time of one optimizer step goes."""

    step_s: float
    """Wall time of one optimizer step (all accumulation micro-steps)."""
    samples_per_second: float
    tokens_per_second: float
    flops_per_step: int
    """Model FLOPs of one optimizer step (`StepFlops.model`: no recomputation)."""
    hardware_flops_per_step: int
    """Hardware FLOPs of one optimizer step (`StepFlops.hardware`: with recomputation)."""
    mfu: float
    """Model FLOPs utilisation: model FLOP/s over the GPU's dense peak for the dtype."""
    hfu: float
    """Hardware FLOPs utilisation: the same with gradient checkpointing's recomputation counted."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: forward, backward, optimizer."""
    hidden_communication_s: float = 0.0
    """Seconds of collectives that run while the device computes: not in `step_s` (estimate/time/collectives.py)."""
    classes_s: dict[str, float] = field(default_factory=dict)
    """Seconds per operation class: contraction, normalization, elementwise, other."""
    calibrated: bool = False
    """True once the efficiency factors come from measured GPU runs (published or the user's)."""
    calibration: str = ""
    """Which calibration the figures use and its known error, in words (`Calibration.describe`)."""
    error_median_pct: float | None = None
    """The calibration's median error in percent (cross-validated for a published one), if known."""
    error_worst_pct: float | None = None
    """Its worst error in percent, if known."""
    interval: Interval | None = None
    """The likely range of `step_s` in seconds, and what it rests on (`intervals.time_interval`: held-out errors of
    published runs)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
