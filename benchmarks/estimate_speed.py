"""How fast is `anatomist estimate`? Wall time of the CLI, and of 100 recipes in one process.

Run: .venv/bin/python benchmarks/estimate_speed.py   (prints a table; no GPU needed)
"""

from __future__ import annotations

import itertools
import os
import platform
import subprocess
import sys
import time

from anatomist.estimate.memory import estimate_memory
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.workload import load_workload


def cli_wall_s() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "anatomist", "estimate", "bert-large-uncased", "--json"],
                   check=True, capture_output=True)
    return time.perf_counter() - start


def hundred_recipes() -> tuple[int, float]:
    workload = load_workload("bert-large-uncased")
    gpu = get_gpu("A100-80GB")
    grid = itertools.product(
        (1, 2, 4, 8, 16), (1, 4), (False, True), ("fp32", "bf16"), ("adamw_torch", "adafactor", "adamw_bnb_8bit"),
    )
    recipes = []
    for batch, accumulation, checkpointing, precision, optim in grid:
        recipes.append(Recipe(per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                              gradient_checkpointing=checkpointing, bf16=precision == "bf16", optim=optim))
    recipes = recipes[:100]
    start = time.perf_counter()
    for recipe in recipes:
        estimate_memory(workload, recipe, gpu)
    return len(recipes), time.perf_counter() - start


if __name__ == "__main__":
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    runs = [cli_wall_s() for _ in range(3)]
    print(f"anatomist estimate bert-large-uncased (CLI, wall, 3 runs): {', '.join(f'{r:.2f} s' for r in runs)}; median {sorted(runs)[1]:.2f} s")
    n, seconds = hundred_recipes()
    print(f"{n} different recipes for bert-large-uncased in one process: {seconds:.1f} s ({seconds / n:.2f} s per recipe)")
