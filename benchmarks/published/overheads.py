"""Measure the two host-side costs the time model's overheads stand for, on this machine's CPU:

1. the Trainer's own loop per optimizer step and per micro-batch, around a 1-parameter model whose
   forward and backward are a few tiny ops (data loader, collation, autocast context, the loss's
   NaN check, clipping, optimizer and scheduler steps, logging, callbacks);
2. the host time of one eager op with autograd (a chain of multiplies, forward and backward).

The time model bounds its overheads by these (estimate/time_model.py: KERNEL_OVERHEAD_MAX_S,
MICRO_BATCH_OVERHEAD_S and MICRO_BATCH_OVERHEAD_MAX_S), so that an overhead never absorbs work the roofline misses. A GPU host
adds the launch itself and a host-to-device copy; it usually has a faster CPU than this one.

    PYTHONPATH=src python benchmarks/published/overheads.py
"""

from __future__ import annotations

import tempfile
import time
from typing import Any


def trainer_loop_s(accumulation: int, steps: int = 400) -> float:
    """Seconds per optimizer step of the Trainer around a model that does almost nothing: the 10th
    percentile of the steps after a warm-up (other jobs on a shared CPU only ever add time)."""
    import torch
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class OneParameter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": (self.w * input_ids.float().mean()).sum()}

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 10**6

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": torch.ones(8, dtype=torch.long), "labels": torch.zeros(8, dtype=torch.long)}

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.last: float | None = None

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now

    times = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
                                 max_steps=steps, logging_steps=10, report_to=[], save_strategy="no", use_cpu=True,
                                 disable_tqdm=True, log_level="error")
        Trainer(model=OneParameter(), args=args, train_dataset=Tokens(), callbacks=[times]).train()
    return float(sorted(times.times[steps // 8:])[len(times.times[steps // 8:]) // 10])


def eager_op_s(length: int = 100, repeats: int = 30) -> float:
    """Host seconds of one eager op with autograd: a chain of multiplies on 4 elements, forward and
    backward (2 x length + 1 kernels); the fastest of `repeats` chains (contention only adds time)."""
    import torch

    x = torch.ones(4, requires_grad=True)

    def chain() -> float:
        start = time.perf_counter()
        y = x
        for _ in range(length):
            y = y * 1.0001
        y.sum().backward()
        return time.perf_counter() - start

    for _ in range(10):
        chain()
    return min(chain() for _ in range(repeats)) / (2 * length + 1)


if __name__ == "__main__":
    one, four = trainer_loop_s(1), trainer_loop_s(4)
    per_micro_batch = (four - one) / 3
    print(f"Trainer loop: {one * 1e3:.2f} ms per optimizer step of 1 micro-batch, {four * 1e3:.2f} ms of 4 "
          f"({per_micro_batch * 1e3:.2f} ms per micro-batch, {(one - per_micro_batch) * 1e3:.2f} ms per step besides)")
    print(f"eager op with autograd: {eager_op_s() * 1e6:.1f} us of host time per op")
