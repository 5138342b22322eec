"""Measured anatomy on real CPU runs: callback summary, track(), prediction line by line."""

from __future__ import annotations

import json

import pytest
import torch

from anatomist.anatomy import TENSOR_CATEGORIES, MemoryAnatomy
from anatomist.bench.worker import build_dataset, predict
from anatomist.estimate.time.ops import step_flops
from anatomist.measure import AnatomistCallback, track
from anatomist.measure.monitor import device_snapshot
from anatomist.recipe import Recipe
from anatomist.recipe.spellings import training_arguments
from anatomist.workload_loader import load_workload

TINY_BERT = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64, "vocab_size": 30522, "max_position_embeddings": 64}


def _workload(tmp_path, seq_len=16):
    (tmp_path / "config.json").write_text(json.dumps(TINY_BERT))
    return load_workload(str(tmp_path), seq_len=seq_len, task="sequence-classification")


def _param_bytes(workload) -> int:
    # fp32 parameters + buffers, each storage rounded up to the caching allocator's 512 B block
    # (measurement and prediction are both sized that way): e.g. a 32-float bias = 128 B -> 512 B
    model = workload.build_model("sdpa")
    return sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in [*model.parameters(), *model.buffers()])


def _train(workload, recipe, tmp_path, num_samples=16):
    from transformers import Trainer

    callback = AnatomistCallback(tokens_per_sample=workload.seq_len, print_at_end=True)
    args = training_arguments(recipe, str(tmp_path / "out"), num_train_epochs=1, report_to="none",
                                        save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True)
    model = workload.build_model(recipe.attn_implementation)
    Trainer(model=model, args=args, train_dataset=build_dataset(workload, num_samples), callbacks=[callback]).train()
    return callback.summary


def test_callback_summary_on_tiny_trainer_run(tmp_path, capsys):
    workload = _workload(tmp_path)
    summary = _train(workload, Recipe(per_device_train_batch_size=4), tmp_path)
    assert summary.steps == 4  # 16 samples / 4 per step
    assert summary.samples_per_second > 0 and summary.tokens_per_second == pytest.approx(summary.samples_per_second * 16)
    assert summary.device["source"] == "process" and summary.device["peak_bytes"] > 0
    memory = summary.memory
    assert isinstance(memory, MemoryAnatomy)  # the type the estimator returns
    assert memory.peak_allocated == sum(memory.category_bytes(c) for c in TENSOR_CATEGORIES)
    assert "run summary" in capsys.readouterr().err


def test_measured_categories_line_up_with_prediction(tmp_path):
    workload = _workload(tmp_path)
    recipe = Recipe(per_device_train_batch_size=4).resolved(workload)
    measured = _train(workload, recipe, tmp_path).memory.to_dict()
    predicted, _notes = predict(workload, recipe)
    weights = _param_bytes(workload)
    # AdamW keeps exp_avg + exp_avg_sq (2 x fp32 params) + a step scalar per param: ~2 x weights
    assert measured["weights"] == weights
    assert abs(measured["optimizer_states"] - 2 * weights) < 0.01 * weights
    assert measured["peak_phase"] == predicted["memory"]["peak_phase"] == "optimizer"
    for key in ("weights", "optimizer_states", "gradients"):
        assert measured[key] == pytest.approx(predicted["memory"][key], rel=0.01), key
    assert predicted["memory"]["device_total"] is None  # no CPU analogue: not invented


def test_activations_measured_at_a_backward_peak(tmp_path):
    workload = _workload(tmp_path, seq_len=64)
    recipe = Recipe(per_device_train_batch_size=64, attn_implementation="eager").resolved(workload)
    measured = _train(workload, recipe, tmp_path, num_samples=128).memory.to_dict()
    predicted, _ = predict(workload, recipe)
    # eager attention keeps [b, heads, s, s] = 64*2*64*64*4 B = 2 MiB of probabilities per layer (and more)
    assert measured["peak_phase"] in ("forward", "backward")
    assert measured["activations"] > 2 * 2 * 2**20
    assert measured["activations"] == pytest.approx(predicted["memory"]["activations"], rel=0.25)


def test_track_plain_loop(tmp_path):
    workload = _workload(tmp_path)
    model = workload.build_model("sdpa")
    model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = {"input_ids": torch.randint(100, 30000, (2, 16)), "labels": torch.tensor([0, 1])}
    flops = step_flops(workload, Recipe(per_device_train_batch_size=2, optim="adamw_torch", gradient_checkpointing=True).resolved(workload))
    assert flops.hardware > flops.model
    with track(model, optimizer, samples_per_step=2, tokens_per_sample=16, print_at_end=False,
               flops=flops, peak_flops=1e12) as t:
        for _ in range(4):
            t.step_begin()
            model(**batch).loss.backward()
            t.before_optimizer_step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t.step_end()
    assert t.summary.steps == 4 and len(t.recorder.step_times_s) == 3  # the attributed step is left out
    assert t.summary.memory.gradients == t.summary.memory.weights - sum(
        -(-b.untyped_storage().nbytes() // 512) * 512 for b in model.buffers())
    assert not model._forward_hooks and not model._forward_pre_hooks  # hooks removed
    # MFU counts the model FLOPs (no recomputation), HFU the hardware FLOPs; both are stored
    assert t.summary.mfu == pytest.approx(flops.model / t.summary.median_step_s / 1e12)
    assert t.summary.hfu == pytest.approx(flops.hardware / t.summary.median_step_s / 1e12)
    assert {"mfu", "hfu"} <= set(t.summary.to_dict())


def test_process_snapshot_without_gpu():
    snap = device_snapshot()
    if torch.cuda.is_available():
        pytest.skip("GPU present")
    assert snap.source == "process" and snap.used_bytes > 0 and snap.total_bytes is None
