"""Run a recipe on several processes through the real engine: `accelerate launch`.

`run_distributed` writes the accelerate config that `anatomist plan --emit accelerate` would
write for the recipe, launches `anatomist.bench.dist_worker` on `num_processes` processes
(on a machine without CUDA the worker asks Accelerator for CPU, which forms a gloo group:
accelerate's MULTI_CPU), and returns the per-process measured bytes next to the
per-device prediction of `estimate_memory(..., num_gpus=num_processes)`.
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


def run_distributed(
    model: str,
    recipe: Recipe,
    num_processes: int,
    *,
    seq_len: int = 64,
    steps: int = 3,
    gpu: GPU | None = None,
    timeout_s: float = 600,
) -> dict[str, Any]:
    """Launch `recipe` on `num_processes` processes; return measured and predicted bytes per process.

    Raises:
        InputError: num_processes < 2; RuntimeError if the launch fails (stderr tail included).
    """
    if num_processes < 2:
        raise InputError(f"num_processes must be at least 2 for a distributed run, got {num_processes}")
    import torch

    if recipe.sharding_stage or recipe.offload != "none":
        if not torch.cuda.is_available():
            raise InputError(
                "DeepSpeed and FSDP launches need CUDA GPUs (accelerate's FSDP plugin refuses a CPU-only machine and "
                "DeepSpeed's CPU backend needs oneCCL); on this machine run plain data parallel (no --zero-stage/--fsdp)"
            )
    from anatomist.estimate.memory import estimate_memory
    from anatomist.workload import load_workload

    with tempfile.TemporaryDirectory(prefix="anatomist-dist-") as tmp:
        cfg = Path(tmp, "accelerate.yaml")
        cfg.write_text(yaml.safe_dump(accelerate_config(recipe, num_processes)))
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg),
               "--num_processes", str(num_processes), "--main_process_port", str(_free_port())]
        cmd += ["-m", "anatomist.bench.dist_worker", "--model", model, "--seq-len", str(seq_len),
                "--recipe", json.dumps(recipe.to_dict()), "--steps", str(steps), "--out", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, timeout=timeout_s)
        if proc.returncode:
            raise RuntimeError(f"accelerate launch failed ({proc.returncode}): {_root_error(proc.stderr)}")
        ranks = [json.loads(Path(tmp, f"rank{i}.json").read_text()) for i in range(num_processes)]
    workload = load_workload(model, seq_len=seq_len)
    predicted = estimate_memory(workload, recipe.resolved(workload), gpu or get_gpu("A100-80GB"), num_gpus=num_processes).anatomy
    return {
        "model": model,
        "recipe": recipe.to_dict(),
        "num_processes": num_processes,
        "measured": ranks,
        "predicted": {"memory": {c: getattr(predicted, c) for c in CATEGORIES}},
    }
