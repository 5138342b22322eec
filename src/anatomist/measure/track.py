"""`track()`: the callback's measurements for a plain PyTorch or Accelerate loop.

    with anatomist.measure.track(model, optimizer, samples_per_step=8, tokens_per_sample=512) as t:
        for batch in loader:
            t.step_begin()
            loss = model(**batch).loss; accelerator.backward(loss)
            t.before_optimizer_step()        # optional: settles the gradients for attribution
            optimizer.step(); optimizer.zero_grad(set_to_none=True)
            t.step_end()
    t.summary                                # RunSummary, printed on exit

With `recipe=` (its TrainingArguments-named fields), `tokens_per_sample` and a GPU (found through NVML,
or `gpu=` / `limit_bytes=`), the loop is pre-flighted as `AnatomistCallback` does it ("warn" logs the
prediction, "refuse" raises `PreflightRefused` before the block runs), and after its first steps the
measured peaks and step time are logged beside the prediction and kept as a run record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN
from anatomist.errors import InputError
from anatomist.measure.recorder import Recorder, RunSummary
from anatomist.measure.summary import print_summary
from anatomist.measure.watch import Watch, logger

if TYPE_CHECKING:
    from anatomist.anatomy import StepFlops
    from anatomist.hardware import GPU
    from anatomist.measure.preflight import Preflight
    from anatomist.recipe import Recipe
    from anatomist.workload import Workload


class Tracker:
    """Handle yielded by `track()`: call step_begin/step_end around each optimizer step."""

    def __init__(self, model: torch.nn.Module | None, optimizer: Any, lower: torch.dtype | None, recorder: Recorder,
                 watch: Watch | None = None):
        self._model, self._optimizer, self._lower, self.recorder = model, optimizer, lower, recorder
        self.watch = watch
        self.summary: RunSummary | None = None

    @property
    def preflight(self) -> Preflight | None:
        """The pre-flight made before the loop (None: none asked, or it could not be made: `watch.skipped`)."""
        return self.watch.result if self.watch is not None else None

    def step_begin(self) -> None:
        self.recorder.step_begin(self._model, self._optimizer, self._lower)

    def before_optimizer_step(self) -> None:
        self.recorder.before_optimizer_step()

    def step_end(self) -> None:
        self.recorder.step_end(self._optimizer)
        if self.watch is not None and self.watch.result is not None and self.watch.comparison is None:
            logs = self.watch.compare(self.recorder)
            if logs is not None:
                logger.warning("anatomist measured vs predicted: %s", logs)


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
    recipe: Recipe | dict[str, Any] | None = None,
    num_processes: int = 1,
    preflight: str | None = "warn",
    gpu: str | GPU | None = None,
    limit_bytes: int | None = None,
    memory_margin: float = DEFAULT_MEMORY_MARGIN,
    compare_after_steps: int = 3,
    record: bool | str | Path = True,
) -> Iterator[Tracker]:
    """Pre-flight the loop, then measure it inside the `with` block; print the summary when it ends.

    Args:
        model, optimizer: needed for the memory attribution (else only time and device memory).
        samples_per_step: samples per optimizer step, for samples/s.
        mixed_precision: "no", "fp16" or "bf16" (the autocast dtype, for weight copies).
        flops, peak_flops: a step's model and hardware FLOPs and the GPU's peak FLOP/s, for MFU
            and HFU (both needed; see `mfu_inputs`).
        recipe: the loop's settings, for the pre-flight: a Recipe or a dict of its (TrainingArguments)
            field names (per_device_train_batch_size, gradient_accumulation_steps, optim, ...); what
            `model` says (dtype, LoRA, 4/8-bit base) wins. None: no pre-flight (it says so).
        num_processes: data-parallel processes (`accelerator.num_processes`).
        preflight, gpu, limit_bytes, memory_margin, compare_after_steps, record: as `AnatomistCallback`'s,
            but "fit" is refused: track() cannot change a loop's batch (read `t.preflight` under "warn").

    Raises:
        PreflightRefused: preflight="refuse" and the loop will not fit (before the block runs).
        InputError: an unknown preflight, "fit", a budget below the weights alone.
    """
    if preflight == "fit":
        raise InputError("track(preflight=\"fit\"): track() cannot change your loop's batch; use \"refuse\" (the "
                         "error says the pair that fits) or \"warn\" and read t.preflight.change")
    watch = Watch(mode=preflight, gpu=gpu, limit_bytes=limit_bytes, memory_margin=memory_margin,
                  compare_after_steps=compare_after_steps, record=record)
    watch.check(lambda: _inputs(model, recipe, tokens_per_sample, num_processes))
    lower = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision)
    recorder = Recorder(samples_per_step=samples_per_step, tokens_per_sample=tokens_per_sample,
                        attribute_step=attribute_step, log_every=log_every, flops=flops,
                        peak_flops=peak_flops)
    tracker = Tracker(model, optimizer, lower, recorder, watch)
    try:
        yield tracker
    finally:
        if recorder.attributor is not None and recorder.attributor.active:
            recorder.attributor.end(optimizer)  # the loop left mid-step: undo the hooks and the tracer
        tracker.summary = recorder.summary()
        if print_at_end:
            print_summary(tracker.summary)


def _inputs(model: torch.nn.Module | None, recipe: Recipe | dict[str, Any] | None, tokens_per_sample: int | None,
            num_processes: int) -> tuple[Workload, Recipe, int]:
    """The workload, recipe and devices of a loop, for the pre-flight (InputError: what is missing)."""
    from anatomist.measure.live import live_workload, model_fields
    from anatomist.recipe import Recipe

    if model is None or recipe is None or tokens_per_sample is None:
        missing = [name for name, v in (("model", model), ("recipe", recipe), ("tokens_per_sample", tokens_per_sample))
                   if v is None]
        raise InputError(f"track() needs {', '.join(missing)} for a pre-flight")
    base = recipe if isinstance(recipe, Recipe) else Recipe.from_dict(dict(recipe), source="track(recipe=...)")
    return live_workload(model, seq_len=tokens_per_sample), base.replace(**model_fields(model)), max(num_processes, 1)
