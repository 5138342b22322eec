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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--task", default="sequence-classification")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--recipe", required=True, help="recipe JSON")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from accelerate import Accelerator

    from anatomist.bench.worker import enable_checkpointing, optimizer_class, training_model
    from anatomist.recipe import Recipe
    from anatomist.trace.step.inputs import make_batch
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
    grads_bytes = 0

    def step(tracker: Any = None) -> None:
        """One optimizer step of the recipe's micro-batches, as the Trainer's loop runs it under accelerate."""
        nonlocal grads_bytes
        for micro in range(recipe.gradient_accumulation_steps):
            if micro and tracker is not None:
                tracker.reset_mod_stats()  # MemTracker follows one call of each module; its peak stays
            with accelerator.accumulate(model):
                loss = model(**make_batch(workload, recipe.per_device_train_batch_size)).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and recipe.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
                grads_bytes = local_nbytes([p.grad for p in model.parameters() if p.grad is not None])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    engine = "deepspeed" if "DEEPSPEED" in str(accelerator.distributed_type) else "ddp"
    peak = buckets = tracked = None
    if engine == "ddp":
        # One step on this process alone makes the optimizer state; DDP's buckets are then made under the tracker,
        # as accelerate wraps the model, and held through the steady-state step it measures.
        step()

        def wrapped_step(tracker: Any) -> None:
            nonlocal model, optimizer
            model, optimizer = accelerator.prepare(model, optimizer)
            step(tracker)

        tracked = _tracked(wrapped_step, recipe, model, optimizer)
        peak = tracked["Total"]
        logged = getattr(model, "_get_ddp_logging_data", None)  # accelerate wraps in DDP from two processes on
        reported = str(logged().get("bucket_sizes", "")) if logged else ""
        buckets = [int(b) for b in reported.replace(" ", "").split(",") if b]
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    states = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    row = {
        "rank": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "engine": engine,
        "distributed_type": str(accelerator.distributed_type),
        "memory": {
            "weights": local_nbytes(list(model.parameters()) + list(model.buffers())),
            "gradients": grads_bytes,
            "optimizer_states": local_nbytes(states),
            "peak_allocated": peak,
        },
        "ddp_buckets": buckets,
        "mem_tracker_peak": tracked,
        "tensor_counts": {
            "weights": len(list(model.parameters())) + len(list(model.buffers())),
            "gradients": sum(1 for p in model.parameters() if p.requires_grad),
            "optimizer_states": len(states),
        },
        "train_runtime_s": elapsed,
        "steps": args.steps,
    }
    Path(args.out, f"rank{accelerator.process_index}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    main()
