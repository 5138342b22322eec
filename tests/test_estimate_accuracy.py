"""Prediction vs PyTorch's own memory accounting of a real training step on the CPU.

The measured side is `torch.distributed._tools.mem_tracker.MemTracker` (PyTorch's tracker,
not anatomist's tracer) over one steady-state step of the full-depth model with real weights
and inputs: the optimizer state exists (a first step ran before tracking), then forward,
backward, clipping, the optimizer step and zero_grad(set_to_none=True), as the Trainer runs
them. The step takes CUDA's code paths (`cuda_code_paths`: the fused attention and dropout
kernels CUDA runs; foreach/fused optimizers) and, under autocast, CUDA's autocast policy
(checked op by op in test_autocast_policy.py): what changes is which kernels run, not how
memory is counted. The prediction extrapolates shallow fake traces (2-3 blocks, batch 2-3)
to 5 blocks at batch 5.

MemTracker rounds each storage to the CUDA allocator's 512 bytes on CUDA devices only
(`_WeakRefInfo._calculate_mem_consumed`); the prediction is for a CUDA device, so the test
has MemTracker apply that same rule to the CPU step.

Under autocast the seeds count the half-precision copies of weights as weights (6 B/param);
MemTracker files them with the activations. For those recipes the expected weights are
MemTracker's parameters plus a bf16 copy of every weight and bias that enters a matrix
product (nn.Linear, GPT-2's Conv1D), worked out from the model's modules.

Compared within 5%: the peak (without the cuBLAS workspaces, which a CPU step has not), and
weights and gradients at it; the optimizer state as MemTracker holds it after the step
(MemTracker files everything allocated inside optimizer.step() under OPT, the step's
temporaries included, where anatomist keeps those under temporary).
"""

from __future__ import annotations

import pytest
import torch
from memtracker_step import count_as_on_cuda, measure_step, round_to_block

from anatomist.estimate.memory import estimate_memory
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")
BATCH = 5  # outside the traced batch sizes (2, 3): extrapolated
RECIPES = {
    "fp32": Recipe(per_device_train_batch_size=BATCH, dtype="float32"),
    "fp32+checkpointing+foreach": Recipe(per_device_train_batch_size=BATCH, dtype="float32",
                                         gradient_checkpointing=True, optim="adamw_torch"),
    "fp32+adafactor": Recipe(per_device_train_batch_size=BATCH, dtype="float32", optim="adafactor"),
    "fp32+bf16-autocast": Recipe(per_device_train_batch_size=BATCH, dtype="float32", bf16=True),
    "pure-bf16": Recipe(per_device_train_batch_size=BATCH, dtype="bfloat16"),
    "pure-bf16+checkpointing+sgd": Recipe(per_device_train_batch_size=BATCH, dtype="bfloat16",
                                          gradient_checkpointing=True, optim="sgd"),
}
CATEGORIES_AT_PEAK = {"weights": ("PARAM", "BUFFER"), "gradients": ("GRAD",)}


def _measured(workload, recipe: Recipe) -> tuple[dict[str, int], dict[str, int]]:
    """MemTracker's snapshots of one steady-state step of the full-depth model, at its peak and after it."""
    torch.manual_seed(0)
    model = workload.build_model(recipe.attn_implementation, recipe.dtype)
    if recipe.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return measure_step(workload, recipe, model, BATCH)


@pytest.fixture
def counted_as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    count_as_on_cuda(monkeypatch)


def _half_copies_bytes(workload, recipe: Recipe) -> int:
    """Bytes of bf16 copies autocast makes of the weights and biases of matrix products."""
    with torch.device("meta"):
        model = workload.build_model(recipe.attn_implementation, recipe.dtype)
    params = {id(p): p for m in model.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
              for p in (m.weight, m.bias) if p is not None}
    return sum(round_to_block(p.numel() * 2) for p in params.values())


@pytest.mark.parametrize("model", [pytest.param("bert", marks=pytest.mark.slow), pytest.param("gpt2", marks=pytest.mark.slow),
                                   "llama"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_prediction_matches_pytorchs_accounting(tiny_model, counted_as_on_cuda, model, recipe_name):
    workload = load_workload(str(tiny_model(model, num_hidden_layers=5, n_layer=5)), seq_len=64)
    recipe = RECIPES[recipe_name].resolved(workload)
    predicted = estimate_memory(workload, recipe.resolved(workload), GPU).anatomy
    measured, after = _measured(workload, recipe)
    workspaces = predicted.functionality  # the two cuBLAS workspaces: nothing on a CPU
    assert predicted.peak_allocated - workspaces == pytest.approx(measured["Total"], rel=0.05)
    copies = _half_copies_bytes(workload, recipe) if recipe.mixed_precision != "no" else 0
    for category, kinds in CATEGORIES_AT_PEAK.items():
        got, want = getattr(predicted, category), sum(measured[k] for k in kinds)
        if category == "weights":
            want += copies
        # 5% of the category, or 1% of the peak for categories nearly empty at the peak
        assert abs(got - want) <= max(0.05 * want, 0.01 * measured["Total"]), (category, got, want, measured)
    assert predicted.optimizer_states == pytest.approx(after["OPT"], rel=0.05)
