"""Suites as data: the shipped seeds suite, user files, bad names."""

from __future__ import annotations

import pytest

from anatomist.bench.suites import load_suite
from anatomist.errors import InputError


def test_seeds_suite_has_the_seeds_rows():
    suite = load_suite("seeds")
    assert suite.model == "bert-large-uncased" and suite.seq_len == 512 and suite.num_samples == 512
    names = [r.name for r in suite.rows]
    for expected in ("vanilla", "grad-accum", "grad-accum+checkpointing", "fp16", "bf16", "tf32", "adafactor",
                     "adam-8bit", "torch-compile", "eager-attention", "dataloader-pin-memory+workers",
                     "accelerate-vanilla"):
        assert expected in names
    accum = next(r for r in suite.rows if r.name == "grad-accum")
    assert (accum.recipe.per_device_train_batch_size, accum.recipe.gradient_accumulation_steps) == (1, 4)


def test_cuda_rows_are_skipped_without_gpu_with_a_reason():
    suite = load_suite("seeds")
    fp16 = next(r for r in suite.rows if r.name == "fp16")
    assert "CUDA" in fp16.skip_reason(has_cuda=False)
    assert fp16.skip_reason(has_cuda=True) is None


def test_missing_package_reason(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: bert-base-uncased\nrows:\n  - name: x\n    needs: [surely_not_installed_pkg]\n")
    row = load_suite(str(path)).rows[0]
    assert "surely_not_installed_pkg" in row.skip_reason(has_cuda=True)


def test_unknown_suite_and_row():
    with pytest.raises(InputError, match="unknown suite 'nope'.*seeds"):
        load_suite("nope")
    with pytest.raises(InputError, match="unknown row\\(s\\) bogus"):
        load_suite("seeds").select(["vanilla", "bogus"])


def test_bad_suite_file_names_the_row(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: bert-base-uncased\nrows:\n  - name: a\n    recipe: {batch: 2}\n")
    with pytest.raises(InputError, match="row 1: unknown recipe field"):
        load_suite(str(path))


def test_distributed_suite_runs_on_two_processes_by_default():
    suite = load_suite("distributed")
    assert suite.num_processes == 2 and suite.task == "causal-lm"
    engines = {r.name: (r.recipe.fsdp, r.recipe.zero_stage) for r in suite.rows}
    assert engines["ddp"] == ("none", 0) and engines["fsdp-full-shard"] == ("full_shard", 0)
    assert engines["fsdp-shard-grad-op"] == ("shard_grad_op", 0)
    zero2 = next(r for r in suite.rows if r.name == "zero2")
    assert "oneCCL" in zero2.skip_reason(has_cuda=False)
    assert load_suite("seeds").num_processes == 1  # a suite without the key
