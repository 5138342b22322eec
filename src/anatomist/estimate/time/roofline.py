"""The time model's six factors, the time of one kernel and of one phase: the formulas the estimate
(`device`), the fit (`calibration.fit`) and the calibration files (`calibration.lookup`) share.

One kernel (an op of the traced step, or a fused kernel of compiled code) takes, on the GPU,

    max(tensor_core_s / tensor_core_efficiency + cuda_core_s / fp32_efficiency,
        memory_s / bandwidth_efficiency) + kernel_overhead_s

where the three `_s` are its seconds at 100% of the GPU's datasheet peaks (`device.peak_seconds`), a matrix
product's on the share of the SMs its shape keeps busy (`tiles.busy_fraction`). The host issues the kernels one
by one and runs ahead of the GPU (a launch is asynchronous): each kernel costs it `host_op_s` in the forward (the
model's Python around the op, the dispatcher, autograd's bookkeeping, the launch), and a measured fraction of that
in the backward (the autograd engine's C++ issues those) and in the optimizer step (`HOST_PHASE_WEIGHTS`), and twice
that for a checkpointed layer's forward run again in the backward (`RECOMPUTE_HOST_WEIGHT`). A phase
of the step (a micro-batch's forward, its backward, the optimizer step) therefore takes

    max(sum of its kernels' GPU times, its kernels x their weights x host_op_s)

whichever of the two is slower: the GPU's work, or the host's issuing of it (a small batch, a Python
loop over parameters). Each micro-batch adds `micro_batch_overhead_s` of host time the GPU waits for
(the training loop's Python, collation and host-to-device copy of the batch, the loss's NaN check that
synchronizes).

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

TIME_MODEL_VERSION = 6
"""Bumped when the meaning of the factors changes; a calibration file of another version is refused.
1: roofline + launch overhead (placeholders); 2: + per-step overhead, bandwidth factor up to 8,
fitted to published runs; 3: every factor bounded to what it physically is, host overhead per
micro-batch; 4: + the host's time per kernel, a phase bound by the slower of the GPU and the host; 5: a matrix
product runs on the share of the GPU its shape keeps busy (`tiles`), so the efficiencies are a busy GPU's; 6: a
checkpointed layer's recomputed forward costs the host twice a forward kernel (`RECOMPUTE_HOST_WEIGHT`)."""

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
HOST_OP_S = 27e-6
"""The host's time per forward kernel where no run tells it: the forward of a 12-layer BERT on the build machine's
CPU, 26.8 us per kernel (HOST_PHASE_WEIGHTS)."""
HOST_PHASE_WEIGHTS = (1.0, 0.46, 0.17)
"""The host's time per kernel in the forward, the backward and a Python loop of an optimizer step (for-loop AdamW,
clipping and zeroing per parameter), relative to the forward's: a 12-layer BERT of hidden size 32 on the build
machine's CPU (one thread, 376 / 673 / 2434 kernels), the fastest of 200 steps, in three runs on the shared machine
26.8 / 11.8 / 4.2, 44.4 / 20.3 / 6.5 and 40.1 / 19.4 / 7.5 us per kernel: backward 0.44-0.48 of the forward,
optimizer 0.15-0.19, their means here (benchmarks/published/overheads.py). On a GPU each kernel's launch adds a few
microseconds the CPU run has not, which would bring the three closer."""
RECOMPUTE_HOST_WEIGHT = 2.0
"""The host's time per kernel of a checkpointed layer's recomputed forward, relative to the forward's: the backward
reruns the layer's Python forward through the saved-tensor hooks of non-reentrant torch.utils.checkpoint
(transformers' default). The same BERT on the build machine's CPU, every layer checkpointed: 360 kernels more in the
backward at 1.96, 2.13 and 2.14 times the forward's host time per kernel (three runs, benchmarks/published/
overheads.py); the seeds' bert-large Trainer steps on an H200 show 1.6 (fp16) to 1.9 (fp32) (benchmarks/gpu/H200:
checkpointing's added step time over its added kernels, with the host time per kernel of the same rows without it)."""
REENTRANT_RECOMPUTE_HOST_WEIGHT = 1.2
"""The same for reentrant torch.utils.checkpoint (torch's only kind until 1.11; transformers' before 4.35): the
backward reruns the layer's forward as plain Python, without the saved-tensor hooks. The same BERT on the build
machine's CPU: 1.19, 1.20 and 1.23 (three runs, `use_reentrant=True`). The guide's 2022 V100 runs are traced so."""
HOST_OP_MAX_S = 60e-6
"""Upper bound of the host's time per kernel: several times what one eager op with autograd costs the build
machine's host (10-12 us, benchmarks/published/overheads.py), room for a slower host and a model's own Python
per op (the module calls around it), not for GPU work the roofline misses."""
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
    host_op_s: float = 0.0
    """Host seconds to issue one forward kernel (Python, dispatcher, autograd, launch): a phase takes at least its
    kernels times this times the phase's weight (module docstring). 0: the host is never the bound (time model 3)."""

    def __post_init__(self) -> None:
        for name in ("tensor_core_efficiency", "fp32_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not EFFICIENCY_MIN <= value <= 1:
                raise ValueError(f"{name} must be in [{EFFICIENCY_MIN}, 1] (a fraction of a datasheet peak), got {value!r}")
        for name, upper in (("kernel_overhead_s", KERNEL_OVERHEAD_MAX_S), ("micro_batch_overhead_s", MICRO_BATCH_OVERHEAD_MAX_S),
                            ("host_op_s", HOST_OP_MAX_S)):
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


def host_kernels(kernels: np.ndarray, recomputed: float = 0.0, recompute_weight: float = RECOMPUTE_HOST_WEIGHT,
                 ) -> np.ndarray:
    """Kernels per phase (forward, backward, optimizer) in forward kernels' worth of the host's time: each phase's
    at its HOST_PHASE_WEIGHTS, the backward's `recomputed` ones (a checkpointed forward run again) at
    `recompute_weight` (RECOMPUTE_HOST_WEIGHT, or REENTRANT_RECOMPUTE_HOST_WEIGHT for reentrant checkpointing)."""
    weighted = np.asarray(kernels, dtype=np.float64) * np.array(HOST_PHASE_WEIGHTS)
    weighted[1] += recomputed * (recompute_weight - HOST_PHASE_WEIGHTS[1])
    return weighted


def phase_s(gpu_s: F, weighted_kernels: F, f: Factors) -> F:
    """Seconds of one phase (or of each of arrays of them): its kernels' GPU seconds, unless the host takes
    longer to issue them: its `weighted_kernels` (`host_kernels`) x `host_op_s`."""
    return np.maximum(gpu_s, weighted_kernels * f.host_op_s)  # type: ignore[no-any-return]
