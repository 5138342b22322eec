"""The bookkeeping shared by `AnatomistCallback` (Trainer) and `track()` (plain loops).

Per optimizer step it takes one `perf_counter` reading (after a CUDA synchronize, which
the Trainer's loss check already forces) and, every `log_every` steps, one memory reading.
One chosen steady-state step is attributed to the memory categories (`StepAttributor`);
that step is slower (the CPU tracer sees every op) and is left out of the throughput.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from anatomist.anatomy import MemoryAnatomy, StepFlops
from anatomist.measure.attribution import StepAttributor
from anatomist.measure.monitor import (
    allocator_stats,
    context_bytes_now,
    cuda_available,
    device_snapshot,
    measure_cuda_context_bytes,
)

if TYPE_CHECKING:
    from anatomist.recipe import Recipe
    from anatomist.workload import Workload


@dataclass(kw_only=True, slots=True)
class RunSummary:
    """What a run came to: time, throughput, memory by category, device memory."""

    train_runtime_s: float
    steps: int
    samples_per_second: float | None
    """Samples per optimizer step / median step time, the attributed step left out."""
    tokens_per_second: float | None
    median_step_s: float | None
    memory: MemoryAnatomy | None
    """The attributed step's memory (the estimate's type); None when no step was attributed."""
    device: dict[str, Any]
    """NVML device memory (GPU) or the process's resident memory (CPU): `source` says which."""
    allocator: dict[str, Any] | None
    cuda_context_bytes: int | None
    mfu: float | None = None
    """Model FLOPs utilisation of the median step (`StepFlops.model`); None without FLOPs and a peak."""
    hfu: float | None = None
    """Hardware FLOPs utilisation: the same with gradient checkpointing's recomputation counted."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """Every `log_every` steps: step, step_s and memory in use."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["memory"] = self.memory.to_dict() if self.memory is not None else None
        return out


class Recorder:
    """Times optimizer steps, samples memory, attributes one step.

    Args:
        samples_per_step: samples of one optimizer step (batch x accumulation x processes).
        tokens_per_sample: for tokens/s; None leaves tokens/s out.
        attribute_step: index (0-based) of the optimizer step to attribute; None: none.
            The default 1 is the first steady-state step (step 0 creates the optimizer state).
        log_every: record memory in `history` every this many steps (0: never).
        flops, peak_flops: FLOPs of one optimizer step and the device's dense peak FLOP/s, for
            MFU and HFU (both needed; `mfu_inputs` gives them).
    """

    def __init__(
        self,
        *,
        samples_per_step: int,
        tokens_per_sample: int | None = None,
        attribute_step: int | None = 1,
        log_every: int = 0,
        flops: StepFlops | None = None,
        peak_flops: float | None = None,
    ) -> None:
        self.samples_per_step = samples_per_step
        self.tokens_per_sample = tokens_per_sample
        self.attribute_step = attribute_step
        self.log_every = log_every
        self.flops = flops
        self.peak_flops = peak_flops
        self.cuda = cuda_available()
        self.context_bytes = measure_cuda_context_bytes() if self.cuda else None
        self.step_times_s: list[float] = []
        self.history: list[dict[str, Any]] = []
        self.attributor: StepAttributor | None = None
        self.memory: MemoryAnatomy | None = None
        self._steps = 0
        self._t0 = time.perf_counter()
        self._step_t0: float | None = None

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def step_begin(self, model: torch.nn.Module | None = None, optimizer: Any = None, lower: Any = None) -> None:
        if self._steps == self.attribute_step and model is not None and optimizer is not None:
            self.attributor = StepAttributor(
                model, device="cuda" if self.cuda else "cpu", lower_precision_dtype=lower,
                cuda_context_bytes=self.context_bytes,
            )
            self.attributor.begin(optimizer)
        self._step_t0 = self._now()

    def before_optimizer_step(self) -> None:
        if self.attributor is not None and self.attributor.active:
            self.attributor.pre_optimizer()

    def step_end(self, optimizer: Any = None) -> None:
        now = self._now()
        attributed = self.attributor is not None and self.attributor.active
        if attributed:
            assert self.attributor is not None
            self.memory = self.attributor.end(optimizer)
        elif self._step_t0 is not None:
            self.step_times_s.append(now - self._step_t0)
        self._steps += 1
        if self.log_every and self._steps % self.log_every == 0:
            snap = device_snapshot()
            self.history.append({"step": self._steps, "step_s": now - (self._step_t0 or now),
                                 "used_bytes": snap.used_bytes, "source": snap.source})
        self._step_t0 = None

    def summary(self) -> RunSummary:
        runtime = time.perf_counter() - self._t0
        median = statistics.median(self.step_times_s) if self.step_times_s else None
        sps = self.samples_per_step / median if median else None
        tps = sps * self.tokens_per_sample if sps is not None and self.tokens_per_sample else None
        mfu: float | None = None
        hfu: float | None = None
        if median and self.flops is not None and self.peak_flops:
            mfu, hfu = self.flops.utilization(median, self.peak_flops)
        stats = allocator_stats()
        return RunSummary(
            train_runtime_s=runtime, steps=self._steps, samples_per_second=sps, tokens_per_second=tps,
            median_step_s=median, memory=self.memory, device=device_snapshot().to_dict(),
            allocator=stats.to_dict() if stats else None, cuda_context_bytes=context_bytes_now(self.context_bytes), mfu=mfu,
            hfu=hfu, history=self.history,
        )


def mfu_inputs(workload: Workload, recipe: Recipe) -> tuple[StepFlops | None, float | None]:
    """What MFU and HFU need: the model and hardware FLOPs of one optimizer step on one device
    (counted on fake tensors by `anatomist.estimate.time.ops.step_flops`) and the local GPU's
    dense peak FLOP/s for the recipe's precision. (None, None) where there is no GPU, or one
    the catalog does not know."""
    from anatomist.hardware import detect_local_gpu

    gpu = detect_local_gpu()
    if gpu is None:
        return None, None
    from anatomist.estimate.time.ops import step_flops
    from anatomist.recipe.axis_values import matmul_precision
    recipe = recipe.resolved(workload)

    return step_flops(workload, recipe, gpu.compute_capability), gpu.peak_tflops(matmul_precision(recipe, gpu)) * 1e12
