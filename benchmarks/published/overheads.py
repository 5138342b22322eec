"""Measure the two host-side costs the time model's overheads stand for, on this machine's CPU:

1. the Trainer's own loop per optimizer step and per micro-batch, around a 1-parameter model whose
   forward and backward are a few tiny ops (data loader, collation, autocast context, the loss's
   NaN check, clipping, optimizer and scheduler steps, logging, callbacks);
2. the host time of one eager op with autograd (a chain of multiplies, forward and backward);
3. the host time per kernel in each phase of a real model's step: the forward of a 12-layer BERT of hidden size 32
   (Transformers' module code around every op), its backward (the autograd engine), and the January 2022 Trainer's
   optimizer step (clipping, for-loop AdamW and zero_ per parameter, in Python), on tensors so small that the
   kernels themselves take almost nothing.

The time model bounds its overheads by these (estimate/time/roofline.py: KERNEL_OVERHEAD_MAX_S,
MICRO_BATCH_OVERHEAD_S and MICRO_BATCH_OVERHEAD_MAX_S), so that an overhead never absorbs work the roofline misses,
and weighs the host's time per kernel by phase with the ratios of 3 (HOST_PHASE_WEIGHTS). A GPU host adds the launch
itself and a host-to-device copy; it usually has a faster CPU than this one.

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


def host_s_per_kernel_by_phase(steps: int = 200, *, checkpointing: bool = False,
                               ) -> tuple[tuple[int, int, int], tuple[float, float, float]]:
    """(kernels, host seconds per kernel) of the forward, the backward and a 2022 Trainer optimizer step of a
    12-layer BERT of hidden size 32 on this CPU, one thread: the fastest of `steps` steps (contention only adds
    time); views are not kernels. With `checkpointing`, every layer checkpointed as the Trainer does it
    (transformers' default, non-reentrant torch.utils.checkpoint): the backward also reruns the layers' forward."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import BertConfig, BertForMaskedLM

    class Kernels(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.count += not func.is_view
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    config = BertConfig(hidden_size=32, num_hidden_layers=12, num_attention_heads=2, intermediate_size=64, vocab_size=64,
                        max_position_embeddings=64, attn_implementation="eager")
    model = BertForMaskedLM(config).train()
    if checkpointing:
        model.activation_checkpointing_enable()
    ids = torch.randint(0, 64, (1, 8))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, foreach=False)

    def forward() -> Any:
        return model(input_ids=ids).logits.sum()

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    for _ in range(5):
        forward().backward()
        optimizer_step()
    counted = [Kernels(), Kernels(), Kernels()]
    with counted[0]:
        loss = forward()
    with counted[1]:
        loss.backward()
    with counted[2]:
        optimizer_step()
    fastest = [float("inf")] * 3
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = forward()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer_step()
        t3 = time.perf_counter()
        fastest = [min(f, t) for f, t in zip(fastest, (t1 - t0, t2 - t1, t3 - t2), strict=True)]
    kernels = tuple(c.count for c in counted)
    per_kernel = tuple(f / k for f, k in zip(fastest, kernels, strict=True))
    return kernels, per_kernel  # type: ignore[return-value]


if __name__ == "__main__":
    one, four = trainer_loop_s(1), trainer_loop_s(4)
    per_micro_batch = (four - one) / 3
    print(f"Trainer loop: {one * 1e3:.2f} ms per optimizer step of 1 micro-batch, {four * 1e3:.2f} ms of 4 "
          f"({per_micro_batch * 1e3:.2f} ms per micro-batch, {(one - per_micro_batch) * 1e3:.2f} ms per step besides)")
    print(f"eager op with autograd: {eager_op_s() * 1e6:.1f} us of host time per op")
    kernels, per_kernel = host_s_per_kernel_by_phase()
    print(f"BERT step (forward, backward, 2022 optimizer step): {kernels} kernels, "
          f"{', '.join(f'{s * 1e6:.1f}' for s in per_kernel)} us of host time per kernel "
          f"({', '.join(f'{s / per_kernel[0]:.2f}' for s in per_kernel)} of the forward's)")
    (_, ckpt_backward, _), (_, ckpt_per_kernel, _) = host_s_per_kernel_by_phase(checkpointing=True)
    recomputed = ckpt_backward - kernels[1]
    per_recomputed = (ckpt_backward * ckpt_per_kernel - kernels[1] * per_kernel[1]) / recomputed
    print(f"checkpointing every layer: the backward issues {recomputed} kernels more (the recomputed forward), "
          f"{per_recomputed * 1e6:.1f} us of host time each ({per_recomputed / per_kernel[0]:.2f} of the forward's)")
