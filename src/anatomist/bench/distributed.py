"""Run a recipe on several processes of this machine, through the launcher a user would use.

- FSDP (`Recipe.fsdp`): `torchrun` (`python -m torch.distributed.run`) starts
  `anatomist.bench.fsdp_worker` on each process; gloo without CUDA, nccl with it. Each rank shards the
  model with accelerate's own `fsdp2_prepare_model`, so FSDP2 really runs on a CPU machine, and
  measures its peak with PyTorch's FSDPMemTracker (see fsdp_worker.py for why not `accelerate launch`).
- plain data parallel (no sharding): `accelerate launch` starts `anatomist.bench.dist_worker` with the
  accelerate config `anatomist plan --emit accelerate` writes; without CUDA the worker asks Accelerator
  for CPU, which forms a gloo group (accelerate's MULTI_CPU: DDP).
- DeepSpeed ZeRO: `accelerate launch` as above, on CUDA only: DeepSpeed's CPU backend needs Intel's
  oneCCL (`oneccl_bindings_for_pytorch`), which this project does not install.

`launch` returns what each process measured; `run_distributed` adds the per-process prediction of
`estimate_memory(..., num_gpus=num_processes)`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from anatomist.errors import InputError
from anatomist.hardware import GPU, get_gpu
from anatomist.plan.emit import accelerate_config
from anatomist.recipe import Recipe
from anatomist.workload import Task

CATEGORIES = ("weights", "gradients", "optimizer_states")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _root_error(stderr: str) -> str:
    """The first exception line a worker printed (the launcher's own traceback comes after it)."""
    errors = re.findall(r"^(?:\w+\.)*\w*(?:Error|Exception): .+$", stderr, flags=re.MULTILINE)
    return errors[0] if errors else stderr[-2000:]


def launcher_for(recipe: Recipe) -> str:
    """The command that starts `recipe`'s processes: "torchrun" for FSDP, "accelerate launch" otherwise."""
    return "torchrun" if recipe.fsdp != "none" else "accelerate launch"


def check_launchable(recipe: Recipe, num_processes: int) -> None:
    """Raise if `recipe` cannot run on `num_processes` processes of this machine.

    Raises:
        InputError: fewer than 2 processes; DeepSpeed ZeRO without CUDA.
    """
    if num_processes < 2:
        raise InputError(f"num_processes must be at least 2 for a distributed run, got {num_processes}")
    import torch

    if recipe.zero_stage and not torch.cuda.is_available():
        raise InputError(
            f"DeepSpeed ZeRO (zero_stage {recipe.zero_stage}) cannot run without CUDA here: DeepSpeed's CPU backend "
            "needs Intel's oneCCL (oneccl_bindings_for_pytorch); on this machine run FSDP (--fsdp) or plain data parallel"
        )


def launch(
    model: str,
    recipe: Recipe,
    num_processes: int,
    *,
    task: Task = "sequence-classification",
    seq_len: int = 64,
    steps: int = 3,
    timeout_s: float = 600,
) -> list[dict[str, Any]]:
    """Run `recipe` on `num_processes` processes; what each measured, by rank.

    Raises:
        InputError: see `check_launchable`. RuntimeError: the launch failed (the first error a worker
        printed); subprocess.TimeoutExpired after `timeout_s`.
    """
    check_launchable(recipe, num_processes)
    worker = ["--model", model, "--seq-len", str(seq_len), "--recipe", json.dumps(recipe.to_dict()),
              "--steps", str(steps)]
    with tempfile.TemporaryDirectory(prefix="anatomist-dist-") as tmp:
        if recipe.fsdp != "none":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
                   str(num_processes), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                   "-m", "anatomist.bench.fsdp_worker", *worker, "--task", task, "--out", tmp]
        else:
            cfg = Path(tmp, "accelerate.yaml")
            cfg.write_text(yaml.safe_dump(accelerate_config(recipe, num_processes)))
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg),
                   "--num_processes", str(num_processes), "--main_process_port", str(_free_port()),
                   "-m", "anatomist.bench.dist_worker", *worker, "--task", task, "--out", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, timeout=timeout_s)
        if proc.returncode:
            raise RuntimeError(f"{launcher_for(recipe)} failed ({proc.returncode}): {_root_error(proc.stderr)}")
        return [json.loads(Path(tmp, f"rank{i}.json").read_text()) for i in range(num_processes)]


def run_distributed(
    model: str,
    recipe: Recipe,
    num_processes: int,
    *,
    task: Task = "sequence-classification",
    seq_len: int = 64,
    steps: int = 3,
    gpu: GPU | None = None,
    timeout_s: float = 600,
) -> dict[str, Any]:
    """Launch `recipe` on `num_processes` processes; return measured and predicted bytes per process.

    Raises:
        InputError, RuntimeError: see `launch`.
    """
    from anatomist.estimate.memory import estimate_memory
    from anatomist.workload_loader import load_workload

    ranks = launch(model, recipe, num_processes, task=task, seq_len=seq_len, steps=steps, timeout_s=timeout_s)
    workload = load_workload(model, seq_len=seq_len, task=task)
    predicted = estimate_memory(workload, recipe.resolved(workload), gpu or get_gpu("A100-80GB"),
                                num_gpus=num_processes).anatomy
    return {
        "model": model,
        "recipe": recipe.to_dict(),
        "num_processes": num_processes,
        "launcher": launcher_for(recipe),
        "measured": ranks,
        "predicted": {"memory": {c: getattr(predicted, c) for c in CATEGORIES}},
    }
