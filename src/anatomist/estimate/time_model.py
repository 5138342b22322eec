"""The time model's five factors and the time of one kernel: the formula the estimate (time.py), the
fit (time_fit.py) and the calibration files (calibration.py) share.

One kernel (an op of the traced step, or a fused kernel of compiled code) takes

    max(tensor_core_s / tensor_core_efficiency + cuda_core_s / fp32_efficiency,
        memory_s / bandwidth_efficiency) + kernel_overhead_s

where the three `_s` are its seconds at 100% of the GPU's datasheet peaks (`time.peak_seconds`), and
each micro-batch adds `micro_batch_overhead_s` of host time the GPU waits for (the training loop's
Python, collation and host-to-device copy of the batch, the loss's NaN check that synchronizes).

Each factor means what its name says, so each is bounded by what it can physically be: the
efficiencies are fractions of a datasheet peak, in (0, 1]; the overheads are host times, bounded by
what the build machine measures them to be (benchmarks/published/overheads.py), so that a fit never
puts work the roofline misses into them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

TIME_MODEL_VERSION = 3
"""Bumped when the meaning of the factors changes; a calibration file of another version is refused.
1: roofline + launch overhead (placeholders); 2: + per-step overhead, bandwidth factor up to 8,
fitted to published runs; 3: every factor bounded to what it physically is, host overhead per
micro-batch."""

EFFICIENCY_MIN = 0.02
"""The lowest efficiency a fit may give (2% of a peak): below it a kernel is not compute- or
bandwidth-bound but something else the model does not know."""
KERNEL_OVERHEAD_MAX_S = 15e-6
"""Upper bound of the per-kernel overhead: the host time of one eager op with autograd, 10-12 us per op
on the build machine (benchmarks/published/overheads.py); NVIDIA's "Getting Started with CUDA Graphs"
(developer.nvidia.com/blog/cuda-graphs) measures a few microseconds of launch cost per kernel."""
MICRO_BATCH_OVERHEAD_S = 1.5e-3
"""The host time per micro-batch where a fit cannot tell it (the published calibration: its runs all
launch about as many kernels per micro-batch, so this and the per-kernel overhead trade off): the
Trainer's loop around a 1-parameter model, 1.4-2.0 ms per optimizer step of one micro-batch on the
build machine (benchmarks/published/overheads.py, three runs)."""
MICRO_BATCH_OVERHEAD_MAX_S = 10e-3
"""Upper bound of the host time per micro-batch: several times MICRO_BATCH_OVERHEAD_S, room for a real
dataset's collation and a slower host, not for work the roofline misses."""

F = TypeVar("F", float, np.ndarray)


@dataclass(kw_only=True, slots=True, frozen=True)
class Factors:
    """The five numbers of the time model (module docstring), checked against their bounds."""

    tensor_core_efficiency: float
    """Fraction of the dense tensor-core peak (fp16, bf16, TF32) a matrix product reaches."""
    fp32_efficiency: float
    """Fraction of the fp32 CUDA-core peak an fp32 matrix product reaches."""
    bandwidth_efficiency: float
    """Fraction of the datasheet memory bandwidth a memory-bound kernel reaches."""
    kernel_overhead_s: float
    """Seconds each kernel adds beyond its roofline time (launch, dispatch, a small kernel's tail)."""
    micro_batch_overhead_s: float
    """Host seconds per micro-batch that the GPU waits for (the training loop around the model)."""

    def __post_init__(self) -> None:
        for name in ("tensor_core_efficiency", "fp32_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not EFFICIENCY_MIN <= value <= 1:
                raise ValueError(f"{name} must be in [{EFFICIENCY_MIN}, 1] (a fraction of a datasheet peak), got {value!r}")
        for name, upper in (("kernel_overhead_s", KERNEL_OVERHEAD_MAX_S), ("micro_batch_overhead_s", MICRO_BATCH_OVERHEAD_MAX_S)):
            value = getattr(self, name)
            if not 0 <= value <= upper:
                raise ValueError(f"{name} must be in [0, {upper:g}] s, got {value!r}")

    def replace(self, **changes: Any) -> Factors:
        return dataclasses.replace(self, **changes)


FACTOR_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Factors))
"""The factors' names, as calibration files spell them."""


def kernel_s(tensor_core_s: F, cuda_core_s: F, memory_s: F, f: Factors) -> F:
    """Seconds of one kernel call (or of each of arrays of them) from its seconds at the peaks."""
    compute = tensor_core_s / f.tensor_core_efficiency + cuda_core_s / f.fp32_efficiency
    return np.maximum(compute, memory_s / f.bandwidth_efficiency) + f.kernel_overhead_s  # type: ignore[no-any-return]
