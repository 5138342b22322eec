"""`track()`: the callback's measurements for a plain PyTorch or Accelerate loop.

    with anatomist.measure.track(model, optimizer, samples_per_step=8, tokens_per_sample=512) as t:
        for batch in loader:
            t.step_begin()
            loss = model(**batch).loss; accelerator.backward(loss)
            t.before_optimizer_step()        # optional: settles the gradients for attribution
            optimizer.step(); optimizer.zero_grad(set_to_none=True)
            t.step_end()
    t.summary                                # RunSummary, printed on exit
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from anatomist.measure.recorder import Recorder, RunSummary
from anatomist.measure.summary import print_summary

if TYPE_CHECKING:
    from anatomist.anatomy import StepFlops


class Tracker:
    """Handle yielded by `track()`: call step_begin/step_end around each optimizer step."""

    def __init__(self, model: torch.nn.Module | None, optimizer: Any, lower: torch.dtype | None, recorder: Recorder):
        self._model, self._optimizer, self._lower, self.recorder = model, optimizer, lower, recorder
        self.summary: RunSummary | None = None

    def step_begin(self) -> None:
        self.recorder.step_begin(self._model, self._optimizer, self._lower)

    def before_optimizer_step(self) -> None:
        self.recorder.before_optimizer_step()

    def step_end(self) -> None:
        self.recorder.step_end(self._optimizer)


@contextlib.contextmanager
def track(
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    *,
    samples_per_step: int,
    tokens_per_sample: int | None = None,
    mixed_precision: str = "no",
    attribute_step: int | None = 1,
    log_every: int = 0,
    print_at_end: bool = True,
    flops: StepFlops | None = None,
    peak_flops: float | None = None,
) -> Iterator[Tracker]:
    """Measure the loop inside the `with` block; print the summary when it ends.

    Args:
        model, optimizer: needed for the memory attribution (else only time and device memory).
        samples_per_step: samples per optimizer step, for samples/s.
        mixed_precision: "no", "fp16" or "bf16" (the autocast dtype, for weight copies).
        flops, peak_flops: a step's model and hardware FLOPs and the GPU's peak FLOP/s, for MFU
            and HFU (both needed; see `mfu_inputs`).
    """
    lower = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision)
    recorder = Recorder(samples_per_step=samples_per_step, tokens_per_sample=tokens_per_sample,
                        attribute_step=attribute_step, log_every=log_every, flops=flops,
                        peak_flops=peak_flops)
    tracker = Tracker(model, optimizer, lower, recorder)
    try:
        yield tracker
    finally:
        if recorder.attributor is not None and recorder.attributor.active:
            recorder.attributor.end(optimizer)  # the loop left mid-step: undo the hooks and the tracer
        tracker.summary = recorder.summary()
        if print_at_end:
            print_summary(tracker.summary)
