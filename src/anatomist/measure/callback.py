"""`AnatomistCallback`: the pre-flight and the memory and throughput of a transformers.Trainer run.

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    callback = AnatomistCallback(tokens_per_sample=512, preflight="fit").attach(trainer)
    trainer.train()          # pre-flight done at attach; summary printed at the end
    callback.summary         # RunSummary: time, samples/s, tokens/s, memory by category
    callback.preflight       # Preflight: the prediction, and the change "fit" made

Pre-flight (`preflight=`, see `anatomist.measure.preflight`): "warn" logs the prediction, "refuse"
raises `PreflightRefused` before the first step when it will not fit, "fit" sets
per_device_train_batch_size and gradient_accumulation_steps to the fastest pair that fits and
keeps the effective batch. When it runs: `attach(trainer)` runs it at once. A callback given to
`Trainer(callbacks=[...])` runs it at `on_init_end`, the end of `Trainer.__init__`, else (added
later with `add_callback`) at `on_train_begin`. "fit" needs `attach`: transformers' Trainer fixes
the batch its dataloader uses (`Trainer._train_batch_size`) in `__init__` before `on_init_end`,
and builds the dataloader, the step count and the optimizer before `on_train_begin`, and no hook
hands a callback the Trainer; `attach` sets the pair on `trainer.args` and `_train_batch_size`,
as the Trainer's own `auto_find_batch_size` does (`Trainer._update_auto_batch_size`).

After `compare_after_steps` optimizer steps the measured peaks and step time are put beside the
prediction: logged through `trainer.log` when attached (so TensorBoard, W&B or trackio show
them), else on the `anatomist` logger, and appended as a run record (`anatomist.measure.run_log`).

Per step the callback costs two perf_counter calls and a list append (benchmarks/callback_overhead.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
from transformers import TrainerCallback

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


class AnatomistCallback(TrainerCallback):
    """Pre-flight and measure a Trainer run; `preflight` and `summary` hold the results.

    Args:
        tokens_per_sample: sequence length, for tokens/s and the pre-flight (None: TRL's max_length
            where the arguments have one, else no pre-flight and no tokens/s).
        attribute_step: optimizer step (0-based) whose memory is attributed; None: none.
        log_every: sample memory every N steps into the summary's history (0: never).
        print_at_end: print the summary table on stderr when training ends.
        flops, peak_flops: a step's model and hardware FLOPs and the GPU's peak FLOP/s, for MFU
            and HFU (both needed; `anatomist.measure.mfu_inputs` gives them).
        preflight: "warn", "refuse", "fit", or None (no pre-flight and no run record).
        gpu: the GPU to predict for (catalog name); None: the GPU NVML finds (none on a CPU machine:
            the pre-flight says so and is skipped unless `gpu` is given).
        limit_bytes: an explicit memory budget for the predicted device total (a CPU test, a GPU shared
            with another job); the margin is then 0.
        memory_margin: share of the GPU's memory kept free when no budget is given.
        compare_after_steps: optimizer steps after which measured and predicted are compared and kept.
        record: where the run record goes: True (`<user cache>/calibration/runs.jsonl`), a path, or False.

    Raises:
        InputError: an unknown `preflight`, a budget that is not a positive integer.
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
        preflight: str | None = "warn",
        gpu: str | GPU | None = None,
        limit_bytes: int | None = None,
        memory_margin: float = DEFAULT_MEMORY_MARGIN,
        compare_after_steps: int = 3,
        record: bool | str | Path = True,
    ) -> None:
        self.tokens_per_sample = tokens_per_sample
        self.attribute_step = attribute_step
        self.log_every = log_every
        self.print_at_end = print_at_end
        self.flops = flops
        self.peak_flops = peak_flops
        self.watch = Watch(mode=preflight, gpu=gpu, limit_bytes=limit_bytes, memory_margin=memory_margin,
                           compare_after_steps=compare_after_steps, record=record)
        self.trainer: Any = None
        self.recorder: Recorder | None = None
        self.summary: RunSummary | None = None
        self._checked = False

    @property
    def preflight(self) -> Preflight | None:
        """The pre-flight made (None: none asked, not yet made, or it could not be: `watch.skipped` says why)."""
        return self.watch.result

    def attach(self, trainer: Any) -> Self:
        """Add this callback to `trainer` and run the pre-flight now (what "fit" needs; see the module)."""
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        self._check(trainer.args, trainer.model)
        return self

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch.mode != "fit":  # "fit" waits for attach (or says at on_train_begin that it needs it)
            self._check(args, kwargs.get("model"))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._check(args, kwargs.get("model"))
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
        if self.recorder is None:
            return
        self.recorder.step_end(kwargs.get("optimizer"))
        if self.watch.result is not None and self.watch.comparison is None:
            logs = self.watch.compare(self.recorder)
            if logs is not None:
                if self.trainer is not None:
                    self.trainer.log(logs)
                else:
                    logger.warning("anatomist measured vs predicted: %s", logs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is None:
            return
        self.summary = self.recorder.summary()
        if self.print_at_end:
            print_summary(self.summary)

    def _check(self, args: Any, model: Any) -> None:
        """The pre-flight, once: the first of attach, on_init_end and on_train_begin that sees the model."""
        if self._checked or model is None:
            return
        self._checked = True
        result = self.watch.check(lambda: self._inputs(args, model))
        if result is None or self.watch.mode != "fit" or result.change is None:
            return
        if self.trainer is None:
            from anatomist.measure.preflight import PreflightRefused

            raise PreflightRefused(f"{result.refusal()}; preflight=\"fit\" changes the batch through the Trainer: "
                                   "AnatomistCallback(preflight=\"fit\", ...).attach(trainer) before trainer.train()")
        if getattr(self.trainer, "is_deepspeed_enabled", False):
            from anatomist.measure.preflight import PreflightRefused

            raise PreflightRefused(f"{result.refusal()}; not changed: DeepSpeed's config took the batch when the "
                                   "Trainer was built; set it in TrainingArguments")
        self._fit(result)

    def _fit(self, result: Preflight) -> None:
        """Set the pair `result` found on the Trainer's arguments and the batch its dataloader will use."""
        assert result.change is not None
        args, new = self.trainer.args, result.change.recipe
        args.per_device_train_batch_size = new.per_device_train_batch_size
        args.gradient_accumulation_steps = new.gradient_accumulation_steps
        self.trainer._train_batch_size = args.train_batch_size  # what _update_auto_batch_size sets
        self.watch.adopt_change()
        logger.warning("anatomist pre-flight (fit) changed %s", result.describe_change())

    def _inputs(self, args: Any, model: Any) -> tuple[Workload, Recipe, int]:
        from anatomist.measure.live import live_recipe, live_workload

        recipe, seq_len = live_recipe(args, model)
        seq_len = self.tokens_per_sample or seq_len
        if seq_len is None:
            raise InputError("tokens per sample unknown: pass AnatomistCallback(tokens_per_sample=...)")
        return live_workload(model, seq_len=seq_len), recipe, max(int(args.world_size), 1)
