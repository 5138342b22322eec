"""On a CUDA GPU: the prediction against the CUDA caching allocator's own counters.

Run with `pytest -m gpu` on a machine with a GPU (skipped elsewhere). Each case runs in a
fresh Python process (the seeds' advice: memory of one run must not leak into the next):
the real model (random init) on the GPU, the Trainer's optimizer, one warm-up step (it
creates the optimizer state), then one measured step after `reset_peak_memory_stats()`.
`max_memory_allocated` is compared with the predicted `peak_allocated`, and
`max_memory_reserved` with `peak_reserved`.

Status: written without a GPU; NOT run yet. The bounds (10% allocated, 20% reserved) are the
first guess to check, not a validated accuracy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from anatomist.estimate.memory import estimate_memory
from anatomist.hardware import detect_local_gpu
from anatomist.recipe import Recipe
from anatomist.workload_loader import load_workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MEASURE = """
import json, sys, torch
from anatomist.measure.profile import training_step
from anatomist.recipe import Recipe
from anatomist.workload_loader import load_workload
folder, seq_len, recipe = sys.argv[1], int(sys.argv[2]), Recipe(**json.loads(sys.argv[3]))
step = training_step(load_workload(folder, seq_len=seq_len), recipe, torch.device("cuda"))
step()
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
step()
torch.cuda.synchronize()
print(json.dumps({"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}))
"""

RECIPES = {
    "vanilla": Recipe(per_device_train_batch_size=8),
    "checkpointing": Recipe(per_device_train_batch_size=8, gradient_checkpointing=True),
    "bf16": Recipe(per_device_train_batch_size=8, bf16=True),
    "fp16+accumulation": Recipe(per_device_train_batch_size=8, fp16=True, gradient_accumulation_steps=2),
    "adafactor+eager": Recipe(per_device_train_batch_size=8, optim="adafactor", attn_implementation="eager"),
}


@pytest.mark.parametrize("model", ["bert", "gpt2", "llama"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_prediction_matches_the_cuda_allocator(tiny_model, model: str, recipe_name: str) -> None:
    folder: Path = tiny_model(model, hidden_size=256, n_embd=256, intermediate_size=1024, num_hidden_layers=6, n_layer=6)
    recipe = RECIPES[recipe_name]
    gpu = detect_local_gpu()
    assert gpu is not None, "the local GPU is not in the catalog (anatomist gpus)"
    predicted = estimate_memory(load_workload(str(folder), seq_len=128), recipe.resolved(load_workload(str(folder), seq_len=128)), gpu).anatomy
    run = subprocess.run([sys.executable, "-c", MEASURE, str(folder), "128", json.dumps(recipe.to_dict())],
                         capture_output=True, text=True, timeout=600, check=True)
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert predicted.peak_allocated == pytest.approx(measured["allocated"], rel=0.10)
    assert predicted.peak_reserved == pytest.approx(measured["reserved"], rel=0.20)
