"""Extrapolation: the prediction from shallow fake traces vs a trace of the full model.

The prediction never sees the full model: it extrapolates traces of 2- and 3-block models at
batch 2 and 3. Here the full-depth model runs one real step on real CPU tensors, recorded by
the same tracer, so this checks the extrapolation (depth, batch, accumulation), not the
tracer: `test_estimate_accuracy.py` measures with PyTorch's own accounting instead.
Both sides count each tensor rounded to the allocator's 512 bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from anatomist.anatomy import TENSOR_CATEGORIES, MemoryCategory, Phase
from anatomist.estimate.memory import estimate_memory, moment_peaks
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.trace.step.driver import trace_step
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")
BATCH = 5  # outside the traced batch sizes (2, 3): extrapolated
RECIPES = {
    "vanilla": Recipe(per_device_train_batch_size=BATCH),
    "checkpointing": Recipe(per_device_train_batch_size=BATCH, gradient_checkpointing=True),
    "bf16": Recipe(per_device_train_batch_size=BATCH, bf16=True),
    "accumulation+eager": Recipe(per_device_train_batch_size=BATCH, gradient_accumulation_steps=4, attn_implementation="eager"),
    "adafactor": Recipe(per_device_train_batch_size=BATCH, optim="adafactor"),
    "8bit+accumulation+checkpointing": Recipe(
        per_device_train_batch_size=BATCH, optim="adamw_bnb_8bit", gradient_accumulation_steps=2, gradient_checkpointing=True
    ),
}


def _measured(workload, recipe):
    real = trace_step(
        workload, recipe.resolved(workload), depth=None, batch_size=BATCH, compute_capability=GPU.compute_capability,
        part="train-step", fake=False,
    )
    peaks = real.peaks()
    key = max(peaks, key=lambda k: peaks[k].allocated)
    return key[0], peaks[key]


@pytest.mark.parametrize("model", [pytest.param("bert", marks=pytest.mark.slow), pytest.param("gpt2", marks=pytest.mark.slow),
                                   "llama"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_extrapolation_matches_a_full_depth_trace(tiny_model, model, recipe_name):
    recipe = RECIPES[recipe_name]
    workload = load_workload(str(tiny_model(model, num_hidden_layers=5, n_layer=5)), seq_len=64)
    predicted = estimate_memory(workload, recipe.resolved(workload), GPU).anatomy
    phase, measured = _measured(workload, recipe)
    # The cuBLAS workspaces (2 x 8.125 MiB, functionality) dwarf a tiny model: compare the rest.
    workspaces = measured.categories[MemoryCategory.FUNCTIONALITY]
    assert predicted.functionality == workspaces
    rest_measured = measured.allocated - workspaces
    rest_predicted = predicted.peak_allocated - predicted.functionality
    assert rest_predicted == pytest.approx(rest_measured, rel=0.05)
    assert predicted.peak_phase == phase
    for category in TENSOR_CATEGORIES:
        got, want = predicted.category_bytes(category), measured.categories[category]
        # 5% of the category, or 1% of the peak for categories that are nearly empty.
        assert abs(got - want) <= max(0.05 * want, 0.01 * rest_measured), (category, got, want)


def test_each_moment_is_the_full_depth_traces(tiny_model):
    """`moment_peaks` names the moments of the step as the traces do, in the full model: the base cut's second
    block is the model's fifth. Each is the same moment of a full-depth trace; the highest is the estimate's peak."""
    workload = load_workload(str(tiny_model("llama", num_hidden_layers=5)), seq_len=64)
    recipe = RECIPES["accumulation+eager"].resolved(workload)
    moments = moment_peaks(workload, recipe, GPU)
    assert max(p.allocated for p in moments.values()) == estimate_memory(workload, recipe, GPU).anatomy.peak_allocated
    real = trace_step(workload, recipe, depth=None, batch_size=BATCH, compute_capability=GPU.compute_capability,
                      part="train-step", fake=False)
    curves = real.curves
    # The optimizer step is traced apart (its micro-step 0); a train-step trace runs it after micro-batch 1.
    passes = {m: p for m, p in moments.items() if m.phase is not Phase.OPTIMIZER}
    assert {(m.micro_step, m.block) for m in passes} == {(micro, b) for micro in (0, 1) for b in (-1, 0, 4)}
    apart = [TENSOR_CATEGORIES.index(c) for c in (MemoryCategory.FUNCTIONALITY, MemoryCategory.OPTIMIZER_STATES)]
    for moment, peak in passes.items():
        points = curves.index[tuple(moment)]
        j = points[np.argmax(curves.allocated[points])]
        # The cuBLAS workspaces (functionality) and the optimizer states dwarf what moves in a tiny model.
        got = peak.allocated - peak.categories[MemoryCategory.FUNCTIONALITY] - peak.categories[MemoryCategory.OPTIMIZER_STATES]
        want = curves.allocated[j] - curves.categories[j][apart].sum()
        assert got == pytest.approx(want, rel=0.005), moment  # measured: within 0.06%
