"""The step-time prediction moves the way the real run moves."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from anatomist.calibration.fit import COARSE as EFFICIENCY_GRID
from anatomist.calibration.lookup import published
from anatomist.calibration.measured import TimedStep, fit_calibration
from anatomist.calibration.published import PRIOR
from anatomist.estimate.time.device import estimate_time
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.workload import Workload
from anatomist.workload_loader import load_workload

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# BERT-large-sized blocks (hidden 1024, 16 heads, intermediate 4096), 2 of them, seq 128, batch 8:
# big enough that matrix products dominate, as in the real model (fake tensors: no cost to trace).
CONFIG = {
    "model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16,
    "intermediate_size": 4096, "vocab_size": 1000, "max_position_embeddings": 256, "type_vocab_size": 2,
}


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Workload:
    folder = tmp_path_factory.mktemp("bert")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return load_workload(str(folder), seq_len=128, task="sequence-classification")


A100 = "A100-80GB"


@pytest.mark.slow
def test_fp16_faster_than_fp32_on_a100(workload: Workload) -> None:
    gpu = get_gpu(A100)
    # 128 x 128 tokens: the GPU's work outlasts the host's issuing of it in every phase
    fp32 = estimate_time(workload, Recipe(per_device_train_batch_size=128).resolved(workload), gpu)
    fp16 = estimate_time(workload, Recipe(per_device_train_batch_size=128, fp16=True).resolved(workload), gpu)
    tf32 = estimate_time(workload, Recipe(per_device_train_batch_size=128, tf32=True).resolved(workload), gpu)
    assert fp16.step_s < tf32.step_s < fp32.step_s
    assert fp16.flops_per_step == fp32.flops_per_step
    # Under autocast the matrix products speed up; the normalizations stay in fp32.
    assert fp16.classes_s["contraction"] < fp32.classes_s["contraction"] / 4


def test_a_small_step_is_bound_by_the_host(workload: Workload) -> None:
    """One sample of 128 tokens through two blocks: the host issues the kernels more slowly than the GPU runs them,
    so faster matrix products (TF32) do not shorten the forward; the GPU's waiting counts as `other`."""
    gpu = get_gpu(A100)
    fp32 = estimate_time(workload, Recipe(per_device_train_batch_size=1).resolved(workload), gpu)
    tf32 = estimate_time(workload, Recipe(per_device_train_batch_size=1, tf32=True).resolved(workload), gpu)
    assert tf32.phases_s["forward"] == pytest.approx(fp32.phases_s["forward"])
    assert tf32.classes_s["contraction"] < fp32.classes_s["contraction"]  # the GPU's own time still falls
    assert tf32.classes_s["other"] > fp32.classes_s["other"]  # and it waits longer for the host


def test_checkpointing_is_slower(workload: Workload) -> None:
    gpu = get_gpu(A100)
    plain = estimate_time(workload, Recipe(per_device_train_batch_size=8).resolved(workload), gpu)
    ckpt = estimate_time(workload, Recipe(per_device_train_batch_size=8, gradient_checkpointing=True).resolved(workload), gpu)
    assert ckpt.step_s > plain.step_s
    assert ckpt.phases_s["backward"] > plain.phases_s["backward"]
    assert ckpt.phases_s["forward"] == pytest.approx(plain.phases_s["forward"])
    # MFU counts the model FLOPs, the same with or without checkpointing: the slower step has
    # the lower MFU; HFU counts the recomputed forward too.
    assert ckpt.flops_per_step == plain.flops_per_step == plain.hardware_flops_per_step
    assert ckpt.hardware_flops_per_step > ckpt.flops_per_step
    assert ckpt.mfu < plain.mfu == pytest.approx(plain.hfu)
    assert ckpt.hfu == pytest.approx(ckpt.mfu * ckpt.hardware_flops_per_step / ckpt.flops_per_step)


def test_accumulation_scales_forward_and_backward_not_optimizer(workload: Workload) -> None:
    gpu = get_gpu(A100)
    one = estimate_time(workload, Recipe(per_device_train_batch_size=8).resolved(workload), gpu)
    four = estimate_time(workload, Recipe(per_device_train_batch_size=8, gradient_accumulation_steps=4).resolved(workload), gpu)
    for phase in ("forward", "backward"):
        assert four.phases_s[phase] == pytest.approx(4 * one.phases_s[phase])
    assert four.phases_s["optimizer"] == pytest.approx(one.phases_s["optimizer"])
    assert four.flops_per_step == 4 * one.flops_per_step
    assert four.samples_per_second > one.samples_per_second  # the optimizer step is amortised


def test_backward_about_twice_forward_and_consistent_totals(workload: Workload) -> None:
    t = estimate_time(workload, Recipe(per_device_train_batch_size=8).resolved(workload), get_gpu(A100))
    assert 1.5 < t.phases_s["backward"] / t.phases_s["forward"] < 3.0  # seeds: backward ~2x forward
    assert sum(t.phases_s.values()) == pytest.approx(t.step_s)
    assert sum(t.classes_s.values()) == pytest.approx(t.step_s)
    assert t.samples_per_second == pytest.approx(8 / t.step_s)
    assert t.tokens_per_second == pytest.approx(8 * 128 / t.step_s)
    assert 0 < t.mfu < 1


def test_the_default_calibration_is_the_published_one_of_the_generation() -> None:
    from anatomist.calibration.lookup import calibration_for

    cal = calibration_for(get_gpu(A100))
    assert cal.calibrated and cal.kind == "published" and cal.generation == "A100"
    assert cal.error is not None and cal.error.method == "leave-one-source-out"
    assert calibration_for(get_gpu("T4")).generation == "any"  # a GPU in no generation: the pooled fit


def test_estimate_json_has_time(workload: Workload) -> None:
    from anatomist.estimate import estimate

    data = estimate(workload, Recipe(per_device_train_batch_size=8), get_gpu(A100)).to_dict()
    t = data["time"]
    assert {"step_s", "samples_per_second", "tokens_per_second", "flops_per_step", "hardware_flops_per_step",
            "mfu", "hfu"} <= set(t)
    assert t["calibrated"] is True and "published runs, A100 generation" in t["calibration"]
    assert t["error_median_pct"] is not None
    inference = estimate(workload, Recipe(per_device_train_batch_size=8), get_gpu(A100), mode="inference").to_dict()
    assert "time" not in inference


@pytest.mark.slow
def test_fit_calibration_recovers_known_factors(workload: Workload) -> None:
    """Step times made with known factors give those factors back. Four factors are free (tensor-core
    and bandwidth efficiencies, the two overheads), so five steps: accumulation tells the host time per
    micro-batch from the per-kernel overhead (a step of 2 x 4 runs as many kernels as one of 8 x 1...
    and four micro-batches)."""
    gpu = get_gpu(A100)
    truth = dataclasses.replace(published()["A100"], factors=published()["A100"].factors.replace(
        tensor_core_efficiency=float(EFFICIENCY_GRID[20]), bandwidth_efficiency=float(EFFICIENCY_GRID[15]),
        kernel_overhead_s=7e-6, micro_batch_overhead_s=3e-3,
    ))
    shapes = ((1, 1, False), (8, 1, False), (4, 1, True), (2, 4, False), (16, 1, False))  # batch, accumulation, ckpt
    recipes = [Recipe(per_device_train_batch_size=b, gradient_accumulation_steps=a, bf16=True, gradient_checkpointing=c)
               for b, a, c in shapes]
    recipes = [r.resolved(workload) for r in recipes]
    steps = [TimedStep(workload=workload, recipe=r, gpu=gpu, step_s=estimate_time(workload, r, gpu, truth).step_s) for r in recipes]
    fitted = fit_calibration(steps, source="synthetic")
    assert fitted.calibrated and fitted.source == "synthetic"
    f = fitted.factors
    assert f.tensor_core_efficiency == pytest.approx(truth.factors.tensor_core_efficiency)
    assert f.bandwidth_efficiency == pytest.approx(truth.factors.bandwidth_efficiency)
    assert f.kernel_overhead_s == pytest.approx(7e-6, rel=1e-3)
    assert f.micro_batch_overhead_s == pytest.approx(3e-3, rel=1e-3)
    assert f.fp32_efficiency == PRIOR.fp32_efficiency  # no fp32 step: the prior's value is kept
    # Three steps cannot tell four factors apart: the overheads keep the prior's values, the efficiencies are fitted.
    few = fit_calibration(steps[:3], source="synthetic").factors
    assert (few.kernel_overhead_s, few.micro_batch_overhead_s, few.host_op_s) == (
        PRIOR.kernel_overhead_s, PRIOR.micro_batch_overhead_s, PRIOR.host_op_s)
    with pytest.raises(ValueError):
        fit_calibration([], source="nothing")


def test_cli_shows_mfu_and_hfu_under_checkpointing(cli, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = (str(tmp_path), "--gpu", A100, "--seq-len", "128", "--batch-size", "8", "--gradient-checkpointing")
    result = cli("estimate", *args, "--json")
    assert result.returncode == 0, result.stderr
    t = json.loads(result.stdout)["time"]
    assert t["hardware_flops_per_step"] > t["flops_per_step"] and t["hfu"] > t["mfu"] > 0
    table = cli("estimate", *args)
    assert table.returncode == 0, table.stderr
    assert "MFU" in table.stdout and "HFU" in table.stdout
    assert f"{t['mfu']:.0%}" in table.stdout and f"{t['hfu']:.0%}" in table.stdout
