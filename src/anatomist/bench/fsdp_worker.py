"""One rank of an FSDP2 bench run, started by `torchrun` (see distributed.py).

    python -m torch.distributed.run --nproc_per_node N -m anatomist.bench.fsdp_worker --model M ...

Why torchrun and not `accelerate launch`: without CUDA, accelerate (1.15) forms a MULTI_CPU group and
ignores an FSDP config (every rank kept every weight, checked), so a sharded step never runs on a CPU
machine through it. Here each rank forms the process group itself (gloo without CUDA, nccl with it)
and wraps the model with accelerate's own `fsdp2_prepare_model`, given the `FullyShardedDataParallelPlugin`
the Trainer builds for `fsdp_version: 2` (reshard_after_forward from the strategy, the recipe's mixed
precision through the plugin's `set_mixed_precision`, `CPUOffloadPolicy` for `offload: cpu`, the
repeated blocks as `transformer_layer_cls_to_wrap`, as `plan --emit` writes them). An accelerate
without FSDP2 (< 1.6) has no `fsdp2_prepare_model`: there `anatomist.trace.step.fsdp.wrap`, which
follows accelerate 1.15's, wraps the model, and the rank's result says so (`wrapped_by`).

The step is the Trainer's: micro-batches under `set_requires_gradient_sync(False)` but the last, the
forward under autocast with mixed precision, backward of loss / accumulation, gradient clipping, the
recipe's optimizer (`Trainer.get_optimizer_cls_and_kwargs`), zero_grad(set_to_none=True).

Each rank writes `rank{R}.json`:
- `memory` (`peak_allocated` and anatomist's categories at it, as `predicted.memory` has them) and
  `fsdp_mem_tracker_peak` (PyTorch's own categories, `_FSDPRefType`): the peak of one more,
  steady-state step under PyTorch's `torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`, whose hooks on a
  unit of several modules are FSDP's group (`trackers`: on each module alone they change the step).
  Without CUDA the steps take CUDA's code paths (`cuda_code_paths`, `cuda_autocast_policy`: which
  kernels run and what they save) and the tracker counts each storage in the CUDA allocator's 512-byte
  blocks, as it does on CUDA (`_PYTORCH_MIN_ALLOCATE`), so the CPU figure is sized as the prediction
  for a GPU is.
- `local_shards.weights / gradients / optimizer_states`: bytes of the shards the rank holds, counted
  from the tensors (`DTensor.to_local()`): parameters and buffers after the steps, the `.grad` tensors
  just before the last optimizer step, the tensors in `optimizer.state`.
- `train_runtime_s`, `median_step_s`: the timed steps, the first (which makes the optimizer state)
  included, the tracked step left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from anatomist.bench.dist_worker import arguments, local_nbytes

TRACKER_CATEGORIES: dict[str, tuple[str, ...]] = {
    "weights": ("SHARDED_PARAM", "UNSHARDED_PARAM", "BUFFER"),
    "gradients": ("SHARDED_GRAD", "UNSHARDED_GRAD"),
    "optimizer_states": ("OPT",),
    "activations": ("ACT",),
    "temporary": ("TEMP",),
    "functionality": ("ALL_GATHER", "REDUCE_SCATTER"),
}
"""FSDPMemTracker's categories (`_FSDPRefType`) under anatomist's (`MemoryCategory`), as
tests/test_fsdp_accuracy.py compares them."""


def _shard(model: torch.nn.Module, recipe: Any, device: torch.device) -> str:
    """Wrap `model` with FSDP2 in place, as the Trainer does; the name of what wrapped it."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from anatomist.axes.shardings import RESHARD_AFTER_FORWARD
    from anatomist.trace.step.fsdp import block_classes

    try:
        from accelerate.utils import FullyShardedDataParallelPlugin, fsdp2_prepare_model
    except ImportError:  # accelerate < 1.6: no FSDP2
        from torch.distributed.device_mesh import init_device_mesh

        from anatomist.trace.step.fsdp import wrap

        wrap(model, recipe, init_device_mesh(device.type, (dist.get_world_size(),)))
        return "anatomist.trace.step.fsdp.wrap (this accelerate has no fsdp2_prepare_model)"
    # Pinned host memory needs CUDA; accelerate's default CPUOffloadPolicy() pins.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if recipe.offload == "cpu" else OffloadPolicy()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=RESHARD_AFTER_FORWARD[recipe.fsdp], cpu_offload=offload,
        auto_wrap_policy="transformer_based_wrap", cpu_ram_efficient_loading=False,
        transformer_cls_names_to_wrap=[c.__name__ for c in block_classes(model)],
    )
    if recipe.mixed_precision != "no":
        plugin.set_mixed_precision(recipe.mixed_precision)
    # fsdp2_prepare_model reads these attributes of the Accelerator; a real Accelerator without CUDA
    # would not shard (module docstring).
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin),
                                        mixed_precision=recipe.mixed_precision, is_main_process=dist.get_rank() == 0,
                                        device=device)
    fsdp2_prepare_model(accelerator, model)
    return f"accelerate.utils.fsdp2_prepare_model (accelerate {_version('accelerate')})"


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _device() -> torch.device:
    """This rank's device, its process group formed (nccl on CUDA; gloo without, the ranks then sharing the cores)."""
    on_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_cuda else "gloo")
    if on_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        return torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))  # ranks side by side on the same cores
    return torch.device("cpu")


@dataclass
class _Training:
    """This rank's sharded model, its optimizer and micro-batches, and one optimizer step of them (the Trainer's)."""

    recipe: Any
    device: torch.device
    model: Any
    """An FSDPModule: its methods are not nn.Module's."""
    params: list[torch.Tensor]
    optimizer: Any
    batches: list[dict[str, torch.Tensor]]
    half: torch.dtype | None
    """The autocast dtype of the recipe's mixed precision, None without."""
    wrapped_by: str
    grads_bytes: int = 0
    """Bytes of the local `.grad` shards just before the last optimizer step."""

    def step(self) -> None:
        accumulation = len(self.batches)
        for micro, inputs in enumerate(self.batches):
            self.model.set_requires_gradient_sync(micro == accumulation - 1)
            autocast = (torch.autocast(self.device.type, dtype=self.half) if self.half is not None
                        else contextlib.nullcontext())
            with autocast:
                loss = self.model(**inputs).loss
            (loss / accumulation).backward()
        if self.recipe.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.recipe.max_grad_norm)
        self.grads_bytes = local_nbytes([p.grad for p in self.params if p.grad is not None])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _training(args: argparse.Namespace, device: torch.device) -> _Training:
    """The model built as bench/worker.py builds it, sharded (`_shard`), its optimizer, and this rank's micro-batches."""
    from anatomist.bench.worker import enable_checkpointing, optimizer_class, training_model
    from anatomist.recipe import Recipe
    from anatomist.recipe.axis_values import autocast_dtype
    from anatomist.trace.step.inputs import make_batch
    from anatomist.workload_loader import load_workload

    workload = load_workload(args.model, seq_len=args.seq_len, task=args.task)
    recipe = Recipe.from_dict(json.loads(args.recipe)).resolved(workload)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="anatomist-fsdp-") as folder:
        model = training_model(workload, recipe, folder).to(device)
    enable_checkpointing(model, recipe)
    wrapped_by = _shard(model, recipe, device)
    params = [p for p in model.parameters() if p.requires_grad]
    cls, kwargs = optimizer_class(recipe)
    optimizer = cls(params, **kwargs)
    name = autocast_dtype(recipe)
    torch.manual_seed(dist.get_rank())  # each rank its own data, as a distributed sampler gives it
    batches = [{k: v.to(device) for k, v in make_batch(workload, recipe.per_device_train_batch_size).items()}
               for _ in range(recipe.gradient_accumulation_steps)]
    return _Training(recipe=recipe, device=device, model=model, params=params, optimizer=optimizer, batches=batches,
                     half=getattr(torch, name) if name is not None else None, wrapped_by=wrapped_by)


def _measured(run: _Training, steps: int) -> tuple[list[float], dict[str, int]]:
    """The times of `steps` timed steps, then FSDPMemTracker's peak (by its categories) of one more, steady-state."""
    from anatomist.bench.trackers import GroupedFSDPMemTracker, as_on_cuda, collectives_hold_nothing

    on_cuda = run.device.type == "cuda"
    times: list[float] = []
    run.model.train()
    with as_on_cuda(run.half is not None):
        for _ in range(steps):
            if on_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            run.step()
            if on_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        tracker = GroupedFSDPMemTracker(run.model, run.optimizer)
        with tracker, contextlib.nullcontext() if on_cuda else collectives_hold_nothing():
            run.step()
    snapshot = tracker.get_tracker_snapshot("peak")
    return times, {str(k).rsplit(".", 1)[-1]: int(v) for k, v in snapshot.get(run.device, {}).items()}


def _row(run: _Training, times: list[float], raw: dict[str, int], steps: int) -> dict[str, Any]:
    """What this rank writes (module docstring)."""
    model, optimizer = run.model, run.optimizer
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {
        "rank": dist.get_rank(),
        "num_processes": dist.get_world_size(),
        "engine": "fsdp2",
        "backend": dist.get_backend(),
        "wrapped_by": run.wrapped_by,
        "memory": {"peak_allocated": raw.get("Total"),
                   **{c: sum(raw.get(k, 0) for k in kinds) for c, kinds in TRACKER_CATEGORIES.items()}},
        "fsdp_mem_tracker_peak": raw,
        "local_shards": {
            "weights": local_nbytes(list(model.parameters()) + list(model.buffers())),
            "gradients": run.grads_bytes,
            "optimizer_states": local_nbytes(states),
        },
        "train_runtime_s": sum(times),
        "median_step_s": statistics.median(times),
        "steps": steps,
    }


def main() -> None:
    args = arguments(task_required=True)
    run = _training(args, _device())
    times, raw = _measured(run, args.steps)
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(_row(run, times, raw, args.steps)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
