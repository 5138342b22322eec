"""`AnatomistCallback`: memory and throughput of a transformers.Trainer run.

    trainer = Trainer(..., callbacks=[AnatomistCallback(tokens_per_sample=512)])
    trainer.train()          # prints the summary at the end
    callback.summary         # RunSummary: time, samples/s, tokens/s, memory by category

The callback times each optimizer step (on_step_begin -> on_step_end) and attributes one
steady-state step to the memory categories (see `anatomist.measure.attribution`); its
per-step cost is two perf_counter calls and a list append (benchmarks/callback_overhead.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from anatomist.measure.recorder import Recorder, RunSummary
from anatomist.measure.summary import print_summary

if TYPE_CHECKING:
    from anatomist.anatomy import StepFlops


class AnatomistCallback(TrainerCallback):
    """Measure a Trainer run; `summary` holds the result after training.

    Args:
        tokens_per_sample: sequence length, for tokens/s (None: tokens/s left out).
        attribute_step: optimizer step (0-based) whose memory is attributed; None: none.
        log_every: sample memory every N steps into the summary's history (0: never).
        print_at_end: print the summary table on stderr when training ends.
        flops, peak_flops: a step's model and hardware FLOPs and the GPU's peak FLOP/s, for MFU
            and HFU (both needed; `anatomist.measure.mfu_inputs` gives them).
    """

    def __init__(
        self,
        *,
        tokens_per_sample: int | None = None,
        attribute_step: int | None = 1,
        log_every: int = 0,
        print_at_end: bool = True,
        flops: StepFlops | None = None,
        peak_flops: float | None = None,
    ) -> None:
        self.tokens_per_sample = tokens_per_sample
        self.attribute_step = attribute_step
        self.log_every = log_every
        self.print_at_end = print_at_end
        self.flops = flops
        self.peak_flops = peak_flops
        self.recorder: Recorder | None = None
        self.summary: RunSummary | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(args.world_size, 1)
        self.recorder = Recorder(
            samples_per_step=samples, tokens_per_sample=self.tokens_per_sample, attribute_step=self.attribute_step,
            log_every=self.log_every, flops=self.flops, peak_flops=self.peak_flops,
        )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is None:
            return
        lower = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else None
        self.recorder.step_begin(kwargs.get("model"), kwargs.get("optimizer"), lower)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.before_optimizer_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.step_end(kwargs.get("optimizer"))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is None:
            return
        self.summary = self.recorder.summary()
        if self.print_at_end:
            print_summary(self.summary)
