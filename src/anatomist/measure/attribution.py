"""Measured anatomy: attribute the live memory of one real training step to the categories.

The categories are the estimator's (`MemoryCategory`), so prediction and measurement line
up line by line. One steady-state step is attributed (the optimizer state exists already,
as in the estimator's trace); hooks mark the phases:

- forward starts at the model's forward pre-hook and ends at its forward hook (what forward
  made and is still alive then is activations);
- backward ends when every trainable parameter's gradient has been accumulated (a
  post-accumulate-grad hook), so clipping and the optimizer step are the optimizer phase;
- gradients are the `.grad` storages before the optimizer step, optimizer states the
  tensors in `optimizer.state`.

Two ways of measuring, chosen by the device:

- CPU: `StepTracer` (the estimator's own TorchDispatchMode) watches the REAL storages of
  the step, and the events are replayed through the same caching-allocator model
  (512-byte blocks) as the prediction, so that both are sized the same way. The step runs
  under `cuda_code_paths()`, i.e. dropout and SDPA take the kernels whose saved tensors
  match CUDA's (the same math, the storage CUDA keeps), and optimizers left to choose their
  implementation (`foreach=None`) take CUDA's default, foreach, instead of the CPU's
  single-tensor loop (which keeps two parameter-sized temporaries where foreach keeps one).
  There is no reserved memory or device total on CPU: those keys are None.
- CUDA: the allocator's counters (`torch.cuda.max_memory_allocated`) are read and reset at
  each phase boundary; weights, gradients and optimizer states are summed from the tensors;
  activations are what forward left allocated; temporary is the rest of the peak.
  Known limitation: within a phase this split is approximate (in backward, gradients are
  counted in full and activations as what forward left); the cuBLAS workspace and
  autocast weight copies are counted under temporary/activations. NOT validated on a GPU yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from anatomist.anatomy import TENSOR_CATEGORIES, MemoryAnatomy, MemoryCategory, Phase
from anatomist.measure.monitor import context_bytes_now
from anatomist.trace.engine.cuda_paths import cuda_code_paths
from anatomist.trace.engine.records import curves_of
from anatomist.trace.engine.tracer import StepTracer


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = int(st.nbytes())
    return sum(seen.values())


@contextlib.contextmanager
def _cuda_default_foreach(optimizer: Any) -> Iterator[None]:
    """Within this context, param groups with `foreach=None` run as on CUDA: foreach."""
    groups = [g for g in getattr(optimizer, "param_groups", []) if "foreach" in g and g["foreach"] is None]
    for group in groups:
        group["foreach"] = True
    try:
        yield
    finally:
        for group in groups:
            group["foreach"] = None


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps one
    return [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


class StepAttributor:
    """Hooks one model; `begin()`/`pre_optimizer()`/`end()` bracket the attributed step.

    Args:
        model: the (unwrapped) model whose forward marks the phases.
        device: "cuda" or "cpu": which way of measuring (see the module docstring).
        lower_precision_dtype: fp16/bf16 under autocast: casts of weights count as weights (CPU).
        cuda_context_bytes: measured context size, added to reserved for device_total (CUDA).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: str,
        lower_precision_dtype: torch.dtype | None = None,
        cuda_context_bytes: int | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.lower = lower_precision_dtype
        self.context_bytes = cuda_context_bytes
        self.active = False
        self.result: MemoryAnatomy | None = None
        self._handles: list[Any] = []
        self._tracer: StepTracer | None = None
        self._exit: contextlib.ExitStack | None = None
        self._phase = Phase.SETUP
        self._cuda_peaks: dict[Phase, int] = {}
        self._reserved_peak = 0
        self._grad_bytes = 0
        self._forward_start = 0
        self._forward_kept = 0
        self._grads_seen = 0
        self._trainable = [p for p in model.parameters() if p.requires_grad]

    # -- phase marks ---------------------------------------------------------------------
    def _enter_phase(self, phase: Phase) -> None:
        if self.device == "cuda":
            self._cuda_peaks[self._phase] = max(self._cuda_peaks.get(self._phase, 0), torch.cuda.max_memory_allocated())
            self._reserved_peak = max(self._reserved_peak, torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
        self._phase = phase
        if self._tracer is not None:
            self._tracer.phase, self._tracer.segment = phase, "pre"

    def _on_forward_begin(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.active or self._phase is Phase.BACKWARD:
            return  # recomputation under gradient checkpointing calls blocks, not the model
        self._enter_phase(Phase.FORWARD)
        self._grads_seen = 0
        if self._tracer is not None:  # the batch came from the DataLoader, outside the trace
            for value in [*args, *kwargs.values()]:
                if isinstance(value, torch.Tensor):
                    self._tracer.register(value, MemoryCategory.ACTIVATIONS)
        elif self.device == "cuda":
            self._forward_start = torch.cuda.memory_allocated()

    def _on_forward_end(self, _module: Any, _args: Any, _kwargs: Any, _output: Any) -> None:
        if not self.active or self._phase is not Phase.FORWARD:
            return
        if self._tracer is not None:
            self._tracer.label_phase_survivors(Phase.FORWARD, MemoryCategory.ACTIVATIONS)
        elif self.device == "cuda":
            self._forward_kept = max(self._forward_kept, torch.cuda.memory_allocated() - self._forward_start)
        self._enter_phase(Phase.BACKWARD)

    def _on_grad(self, _param: torch.Tensor) -> None:
        if not self.active or self._phase is not Phase.BACKWARD:
            return
        self._grads_seen += 1
        if self._grads_seen >= len(self._trainable):
            self._enter_phase(Phase.OPTIMIZER)  # clipping + optimizer step (or the next micro-batch)

    # -- the attributed step ---------------------------------------------------------------
    def begin(self, optimizer: Any) -> None:
        """Start attributing: call at the beginning of a steady-state optimizer step."""
        self._handles = [
            self.model.register_forward_pre_hook(self._on_forward_begin, with_kwargs=True),
            self.model.register_forward_hook(self._on_forward_end, with_kwargs=True),
            *(p.register_post_accumulate_grad_hook(self._on_grad) for p in self._trainable),
        ]
        self._phase = Phase.SETUP
        self.active = True
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        tracer = StepTracer(lower_precision_dtype=self.lower)
        for t in [*self.model.parameters(), *self.model.buffers()]:
            tracer.register(t, MemoryCategory.WEIGHTS)
        for t in _optimizer_tensors(optimizer):
            tracer.register(t, MemoryCategory.OPTIMIZER_STATES)
        for p in self._trainable:
            if p.grad is not None:
                tracer.register(p.grad, MemoryCategory.GRADIENTS)
        self._tracer = tracer
        self._exit = contextlib.ExitStack()
        self._exit.enter_context(cuda_code_paths())
        self._exit.enter_context(_cuda_default_foreach(optimizer))
        self._exit.enter_context(tracer)

    def pre_optimizer(self) -> None:
        """Call right before `optimizer.step()`: the gradients are settled."""
        if not self.active:
            return
        grads = [p.grad for p in self._trainable if p.grad is not None]
        if self._tracer is not None:
            self._tracer.label_live(grads, MemoryCategory.GRADIENTS)
        self._grad_bytes = _storage_bytes(grads)
        if self._phase is not Phase.OPTIMIZER:
            self._enter_phase(Phase.OPTIMIZER)

    def end(self, optimizer: Any) -> MemoryAnatomy:
        """Stop attributing; return the measured anatomy (the estimate's type and categories)."""
        self.active = False
        for h in self._handles:
            h.remove()
        self._handles = []
        states = _optimizer_tensors(optimizer)
        if self._tracer is None:
            self.result = self._cuda_result(states)
            return self.result
        assert self._exit is not None
        self._tracer.label_live(states, MemoryCategory.OPTIMIZER_STATES)
        self._exit.close()
        self._tracer.stop()
        self.result = self._cpu_result(self._tracer)
        self._tracer = None
        return self.result

    def _cpu_result(self, tracer: StepTracer) -> MemoryAnatomy:
        peaks = curves_of(tracer.trace).peaks([Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER])
        (phase, _segment), peak = max(peaks.items(), key=lambda kv: kv[1].allocated)
        return MemoryAnatomy(
            **{str(c): peak.categories[c] for c in TENSOR_CATEGORIES},
            runtime_overhead=None, peak_allocated=peak.allocated, peak_reserved=None, device_total=None,
            peak_phase=phase,
        )

    def _cuda_result(self, states: list[torch.Tensor]) -> MemoryAnatomy:
        self._enter_phase(Phase.SETUP)  # closes the optimizer phase's peak
        peaks = {p: v for p, v in self._cuda_peaks.items() if p is not Phase.SETUP}
        phase = max(peaks, key=peaks.__getitem__) if peaks else Phase.FORWARD
        peak = peaks.get(phase, 0)
        weights = _storage_bytes([*self.model.parameters(), *self.model.buffers()])
        opt = _storage_bytes(states)
        grads = self._grad_bytes if phase is not Phase.FORWARD else 0
        rest = max(0, peak - weights - opt - grads)
        activations = min(self._forward_kept, rest) if phase is not Phase.OPTIMIZER else 0
        reserved = int(self._reserved_peak)
        outside = context_bytes_now(self.context_bytes)  # after the step: its kernels have loaded
        total = reserved + outside if outside is not None else None
        return MemoryAnatomy(
            weights=weights, optimizer_states=opt, gradients=grads, activations=activations,
            temporary=rest - activations, functionality=0,
            runtime_overhead=(total - peak) if total is not None else None,
            peak_allocated=peak, peak_reserved=reserved, device_total=total, peak_phase=phase,
        )
