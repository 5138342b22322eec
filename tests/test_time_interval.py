"""Every predicted step time with the error published runs the fit never saw showed (estimate/intervals.py).

The interval of a step time P is P / (1 + e) between the 10th and 90th percentile of the held-out errors e of the
GPU generation whose calibration P used (data/time_accuracy.toml, written by benchmarks/published/fit.py fit),
widened to hold P; a GPU in no generation, a measured calibration and a recipe no published timed run exercised are
marked not validated, with why.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from anatomist.calibration.lookup import Calibration, CalibrationError, calibration_for, generation_of_gpu, published
from anatomist.estimate.intervals import time_accuracy, time_errors, time_interval
from anatomist.hardware import catalog, get_gpu
from anatomist.recipe import Recipe

STEP_S = 0.1


def _percentiles(regime: str) -> tuple[float, float]:
    errors = time_accuracy()["regimes"][regime]["errors"]
    return float(np.percentile(errors, 10)), float(np.percentile(errors, 90))


@pytest.mark.parametrize("gpu", ["A100-80GB", "V100-16GB", "H100-SXM"])
def test_a_published_generation_takes_its_own_held_out_errors(gpu: str) -> None:
    cal = calibration_for(get_gpu(gpu))
    low, high = _percentiles(f"generation: {cal.generation}")
    interval = time_interval(STEP_S, cal, Recipe())
    # P / (1 + the 90th percentile, at least 0) .. P / (1 + the 10th, at most 0)
    assert interval.low == pytest.approx(STEP_S / (1 + max(high, 0)))
    assert interval.high == pytest.approx(STEP_S / (1 + min(low, 0)))
    assert interval.low <= STEP_S <= interval.high
    assert interval.validated and f"GPU generation {cal.generation}" in interval.basis


def test_the_a100_interval_by_hand() -> None:
    # A100's held-out errors, 10th..90th percentile -12.3%..+11.4% (docs/time.md):
    # 100 ms / 1.114 = 89.8 ms, 100 ms / 0.877 = 114.0 ms
    interval = time_interval(STEP_S, calibration_for(get_gpu("A100-80GB")), Recipe())
    assert interval.low == pytest.approx(0.0898, abs=0.0005)
    assert interval.high == pytest.approx(0.1140, abs=0.0005)


def test_the_intervals_errors_are_the_calibrations_claimed_errors() -> None:
    """The two generated files agree: each generation's median and worst |error| in data/time_calibration.toml are
    those of its signed errors in data/time_accuracy.toml."""
    for name, cal in published().items():
        assert cal.error is not None
        errors = np.abs(time_accuracy()["regimes"][f"generation: {name}"]["errors"]) * 100
        assert len(errors) == cal.error.runs, name
        assert float(np.median(errors)) == pytest.approx(cal.error.median_error_pct, abs=0.06), name
        assert float(errors.max()) == pytest.approx(cal.error.worst_error_pct, abs=0.06), name
        assert time_errors(cal).median_abs * 100 == pytest.approx(cal.error.median_error_pct, abs=0.06), name


def test_a_gpu_in_no_generation_is_not_validated() -> None:
    gpu = next(g for g in catalog().values() if generation_of_gpu(g.name) == "any")
    low, high = _percentiles("generation: any")
    interval = time_interval(STEP_S, calibration_for(gpu), Recipe())
    assert not interval.validated
    assert interval.basis.startswith("not validated: the GPU is in no generation of the published runs")
    assert interval.low == pytest.approx(STEP_S / (1 + max(high, 0)))
    assert interval.high == pytest.approx(STEP_S / (1 + min(low, 0)))


def test_a_measured_calibration_is_in_sample_and_not_validated() -> None:
    cal = Calibration(calibrated=True, kind="measured", gpu="A100-80GB", source="anatomist calibrate: 5 bench rows",
                      factors=published()["A100"].factors,
                      error=CalibrationError(median_error_pct=3.0, worst_error_pct=8.0, runs=5, sources=1,
                                             method="in-sample"))
    interval = time_interval(STEP_S, cal, Recipe())
    # its worst in-sample error either way: 100 ms / 1.08 = 92.6 ms .. 100 ms / 0.92 = 108.7 ms
    assert interval.low == pytest.approx(STEP_S / 1.08)
    assert interval.high == pytest.approx(STEP_S / 0.92)
    assert not interval.validated and "in-sample" in interval.basis


@pytest.mark.parametrize(("recipe", "gpus", "nodes", "why"), [
    (Recipe(peft="lora"), 1, 1, "no published timed run trains adapters"),
    (Recipe(zero_stage=2), 8, 1, "no published timed run of DeepSpeed ZeRO"),
    (Recipe(), 4, 1, "no published timed run of plain data parallelism"),
    (Recipe(fsdp="full_shard"), 16, 2, "the published timed runs are on one node"),
    (Recipe(offload="cpu", zero_stage=3), 1, 1, "no published timed run offloads to the CPU"),
])
def test_a_recipe_no_published_run_timed_keeps_the_range_and_says_why(recipe: Recipe, gpus: int, nodes: int,
                                                                       why: str) -> None:
    cal = calibration_for(get_gpu("A100-80GB"))
    validated = time_interval(STEP_S, cal, Recipe())
    interval = time_interval(STEP_S, cal, recipe, gpus, nodes)
    assert not interval.validated and interval.basis.startswith("not validated: ") and why in interval.basis
    assert (interval.low, interval.high) == (validated.low, validated.high)


def test_fsdp_on_one_node_is_validated() -> None:
    """The llm-foundry runs of the fit are FSDP on one node of 8 GPUs."""
    interval = time_interval(STEP_S, calibration_for(get_gpu("A100-80GB")), Recipe(fsdp="full_shard"), 8, 1)
    assert interval.validated


def test_the_estimate_gives_the_time_interval(cli, tiny_model) -> None:
    model = str(tiny_model("bert", num_hidden_layers=2))
    data = json.loads(cli("estimate", model, "--gpu", "A100-80GB", "--seq-len", "64", "--json").stdout)
    time = data["time"]
    assert set(time["interval"]) == {"low", "high", "validated", "basis"}
    assert time["interval"]["low"] < time["step_s"] < time["interval"]["high"]
    assert time["interval"]["validated"] is True
    text = cli("estimate", model, "--gpu", "A100-80GB", "--seq-len", "64").stdout
    assert f"{time['step_s'] * 1e3:,.1f} ms, likely {time['interval']['low'] * 1e3:,.1f} to" in text
    runs = time_accuracy()["regimes"]["generation: A100"]["runs"]
    assert f"time interval: 10th to 90th percentile of {runs} published runs" in " ".join(text.split())
    lora = json.loads(cli("estimate", model, "--gpu", "A100-80GB", "--seq-len", "64", "--peft", "lora",
                          "--json").stdout)
    assert lora["time"]["interval"]["validated"] is False
