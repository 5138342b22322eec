"""One process of a distributed bench run, started by `accelerate launch` (see distributed.py).

Trains the workload's model (built as bench/worker.py builds it: adapters, checkpointing and the
recipe's optimizer as the Trainer makes them) for a few steps with the real `accelerate.Accelerator`
(which wraps it in DDP or DeepSpeed as the accelerate config says) and writes, per process,
the bytes of the real tensors it holds by category, counted from the objects themselves:
weights = the local parameters and buffers (sharded ones count their local shard),
gradients = the local `.grad` tensors after backward, optimizer_states = the tensors in
`optimizer.state`. This is exact for these three categories on CPU.

Under DDP, `peak_allocated` is the peak of a steady-state step under PyTorch's
`torch.distributed._tools.mem_tracker.MemTracker` (`mem_tracker_peak` by its categories; on CPU with CUDA's
code paths and autocast policy, storages counted in the CUDA allocator's 512-byte blocks, as the FSDP worker
measures): a first step on this process alone makes the optimizer state, then, under the tracker,
accelerate wraps the model in DDP (whose gradient buckets are made then) and the step runs. `ddp_buckets` is
what DDP itself reports of its buckets (`_get_ddp_logging_data()["bucket_sizes"]`). The timed steps follow.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def local_nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages of `tensors` as this process holds them: a DTensor by its local shard, a shared
    storage once."""
    seen, total = set(), 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP2) -> local shard
        key = local.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += local.untyped_storage().nbytes()
    return total


def _tracked(step: Callable[[Any], None], recipe: Any, *external: Any) -> dict[str, int]:
    """MemTracker's peak snapshot of `step` (given the tracker), by its category names and "Total": on CPU with
    CUDA's code paths and autocast policy, storages in the CUDA allocator's 512-byte blocks (module docstring);
    the storages of `external` (the model and optimizer made before) attributed to them."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from anatomist.bench.trackers import as_on_cuda

    tracker = MemTracker()
    tracker.track_external(*external)
    with as_on_cuda(recipe.mixed_precision != "no"), tracker:
        step(tracker)
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    return {str(k).rsplit(".", 1)[-1]: int(v) for k, v in peak.items()}


def arguments(*, task_required: bool) -> argparse.Namespace:
    """The worker's command line (distributed.py writes it): the model, its task and sequence length, the recipe as
    JSON, the steps to time and the folder each rank writes to."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    if task_required:
        parser.add_argument("--task", required=True)
    else:
        parser.add_argument("--task", default="sequence-classification")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--recipe", required=True, help="recipe JSON")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


@dataclass
class _Training:
    """This process's model, optimizer and Accelerator, and one optimizer step of them."""

    workload: Any
    recipe: Any
    accelerator: Any
    model: Any
    optimizer: Any
    grads_bytes: int = 0
    """Bytes of the local `.grad` tensors just before the last optimizer step."""

    @property
    def engine(self) -> str:
        """What wraps the model: "deepspeed" where the accelerate config says so, else "ddp"."""
        return "deepspeed" if "DEEPSPEED" in str(self.accelerator.distributed_type) else "ddp"

    def step(self, tracker: Any = None) -> None:
        """One optimizer step of the recipe's micro-batches, as the Trainer's loop runs it under accelerate."""
        from anatomist.trace.step.inputs import make_batch

        recipe, accelerator, model = self.recipe, self.accelerator, self.model
        for micro in range(recipe.gradient_accumulation_steps):
            if micro and tracker is not None:
                tracker.reset_mod_stats()  # MemTracker follows one call of each module; its peak stays
            with accelerator.accumulate(model):
                loss = model(**make_batch(self.workload, recipe.per_device_train_batch_size)).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and recipe.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
                self.grads_bytes = local_nbytes([p.grad for p in model.parameters() if p.grad is not None])
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)


def _training(args: argparse.Namespace) -> _Training:
    """The workload, the resolved recipe, the Accelerator, and the model and optimizer as bench/worker.py builds them
    (not yet prepared by the Accelerator)."""
    from accelerate import Accelerator

    from anatomist.bench.worker import enable_checkpointing, optimizer_class, training_model
    from anatomist.recipe import Recipe
    from anatomist.workload_loader import load_workload

    workload = load_workload(args.model, seq_len=args.seq_len, task=args.task)
    recipe = Recipe.from_dict(json.loads(args.recipe)).resolved(workload)
    cls, kwargs = optimizer_class(recipe)  # TrainingArguments reset accelerate's state: before the Accelerator
    # Without CUDA the processes must ask for CPU explicitly to form a gloo group (MULTI_CPU).
    accelerator = Accelerator(mixed_precision=recipe.mixed_precision,
                              gradient_accumulation_steps=recipe.gradient_accumulation_steps,
                              cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="anatomist-ddp-") as folder:
        model = training_model(workload, recipe, folder)
    enable_checkpointing(model, recipe)
    optimizer = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    model.train()
    return _Training(workload=workload, recipe=recipe, accelerator=accelerator, model=model, optimizer=optimizer)


@dataclass(frozen=True)
class _DDPPeak:
    """What the tracked steady-state step of DDP measured (module docstring)."""

    peak: int
    buckets: list[int]
    tracked: dict[str, int]


def _prepared(run: _Training) -> _DDPPeak | None:
    """Hand the model and optimizer to the Accelerator; under DDP, measure a steady-state step as it does (None under
    DeepSpeed)."""
    if run.engine != "ddp":
        run.model, run.optimizer = run.accelerator.prepare(run.model, run.optimizer)
        return None
    # One step on this process alone makes the optimizer state; DDP's buckets are then made under the tracker,
    # as accelerate wraps the model, and held through the steady-state step it measures.
    run.step()

    def wrapped_step(tracker: Any) -> None:
        run.model, run.optimizer = run.accelerator.prepare(run.model, run.optimizer)
        run.step(tracker)

    tracked = _tracked(wrapped_step, run.recipe, run.model, run.optimizer)
    logged = getattr(run.model, "_get_ddp_logging_data", None)  # accelerate wraps in DDP from two processes on
    reported = str(logged().get("bucket_sizes", "")) if logged else ""
    return _DDPPeak(peak=tracked["Total"], buckets=[int(b) for b in reported.replace(" ", "").split(",") if b],
                    tracked=tracked)


def _row(run: _Training, ddp: _DDPPeak | None, elapsed: float, steps: int) -> dict[str, Any]:
    """What this process writes: its tensors' bytes by category, DDP's peak and buckets, the timed steps."""
    model, accelerator = run.model, run.accelerator
    inner = run.optimizer.optimizer if hasattr(run.optimizer, "optimizer") else run.optimizer
    states = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {
        "rank": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "engine": run.engine,
        "distributed_type": str(accelerator.distributed_type),
        "memory": {
            "weights": local_nbytes(list(model.parameters()) + list(model.buffers())),
            "gradients": run.grads_bytes,
            "optimizer_states": local_nbytes(states),
            "peak_allocated": ddp.peak if ddp else None,
        },
        "ddp_buckets": ddp.buckets if ddp else None,
        "mem_tracker_peak": ddp.tracked if ddp else None,
        "tensor_counts": {
            "weights": len(list(model.parameters())) + len(list(model.buffers())),
            "gradients": sum(1 for p in model.parameters() if p.requires_grad),
            "optimizer_states": len(states),
        },
        "train_runtime_s": elapsed,
        "steps": steps,
    }


def main() -> None:
    args = arguments(task_required=False)
    run = _training(args)
    ddp = _prepared(run)
    start = time.perf_counter()
    for _ in range(args.steps):
        run.step()
    elapsed = time.perf_counter() - start
    row = _row(run, ddp, elapsed, args.steps)
    Path(args.out, f"rank{run.accelerator.process_index}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    main()
