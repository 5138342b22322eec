"""Every memory figure with the error published GPU runs measured (estimate/intervals.py), and the verdict it gives.

The interval of a predicted device total P is P / (1 + e) over the errors e (predicted / measured - 1) of the
regime's GPU runs, widened to hold P: data/memory_accuracy.toml, written from
benchmarks/published/memory.toml and the lent GPUs' rows (benchmarks/gpu/<device>/bench.jsonl) by `memory.py intervals`; the slow test checks the file against a fresh check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from anatomist.anatomy import Interval
from anatomist.estimate.intervals import ADAPTERS, ONE_GPU, SHARDED, memory_accuracy, memory_interval
from anatomist.recipe import Recipe

ROOT = Path(__file__).parents[1]


def test_the_verdict_reads_the_interval_against_the_limit():
    interval = Interval(low=90.0, high=120.0, validated=True, basis="")
    assert interval.verdict(limit=130) == "fits"  # even the top fits
    assert interval.verdict(limit=100) == "borderline"
    assert interval.verdict(limit=80) == "does not fit"  # even the bottom does not
    assert interval.relative(100.0) == pytest.approx((-0.10, 0.20))


@pytest.mark.parametrize(("recipe", "gpus", "regime"), [
    (Recipe(), 1, ONE_GPU), (Recipe(peft="lora"), 1, ADAPTERS), (Recipe(fsdp="full_shard"), 8, SHARDED),
])
def test_a_validated_regime_takes_its_own_runs_errors(recipe, gpus, regime):
    errors = memory_accuracy()["regimes"][regime]["errors"]
    interval = memory_interval(1000, recipe, gpus)
    # worked out: P / (1 + the largest error, at least 0) .. P / (1 + the smallest, at most 0)
    assert interval.low == pytest.approx(1000 / (1 + max(max(errors), 0)))
    assert interval.high == pytest.approx(1000 / (1 + min(min(errors), 0)))
    assert interval.low <= 1000 <= interval.high
    lent = sum(row.startswith("lent-") for row in memory_accuracy()["regimes"][regime]["rows"])
    assert interval.validated and f"{len(errors) - lent} published GPU run" in interval.basis
    assert (f" and {lent} of our own" in interval.basis) == (lent > 0)


@pytest.mark.parametrize(("recipe", "gpus", "why"), [
    (Recipe(zero_stage=2), 8, "no published GPU run of DeepSpeed ZeRO"),
    (Recipe(), 4, "no published GPU run of plain data parallelism"),
])
def test_a_regime_no_run_measured_says_so_and_takes_every_runs_range(recipe, gpus, why):
    errors = [e for r in memory_accuracy()["regimes"].values() for e in r["errors"]]
    interval = memory_interval(1000, recipe, gpus)
    assert not interval.validated and interval.basis.startswith(f"not validated: {why}")
    assert interval.high == pytest.approx(1000 / (1 + min(min(errors), 0)))


def test_the_estimate_gives_the_interval_and_a_borderline_verdict(cli, tiny_model):
    model = str(tiny_model("llama"))
    first = json.loads(cli("estimate", model, "--gpu", "A100-80GB", "--json").stdout)
    memory = first["memory"]
    assert memory["interval"]["low"] <= memory["device_total"] <= memory["interval"]["high"]
    assert first["verdict"] == "fits"
    # a limit between the interval's bottom and top: --memory-margin makes it so
    inside = (memory["interval"]["low"] + memory["interval"]["high"]) / 2
    margin = 1 - inside / first["gpu"]["memory_bytes"]
    second = cli("estimate", model, "--gpu", "A100-80GB", "--memory-margin", f"{margin:.6f}")
    assert second.returncode == 0
    assert "borderline: inside the interval" in second.stdout
    assert "memory interval: " in second.stdout


@pytest.mark.slow
def test_the_shipped_errors_are_a_fresh_check_of_the_published_runs(tmp_path: Path):
    """data/memory_accuracy.toml is what `memory.py intervals` writes today (but its date line): the published runs and
    the lent GPUs' rows."""
    shipped = (ROOT / "src/anatomist/data/memory_accuracy.toml").read_text()
    proc = subprocess.run([sys.executable, "-c", (
        "import sys; sys.path.insert(0, 'benchmarks/published'); import memory; "
        "sys.stdout.write(memory.accuracy_table(memory.check(memory.load()['rows']) + memory.gpu_rows(), 'today'))")],
        cwd=ROOT, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""}, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-2000:]

    def body(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith(("measured", "#"))]

    assert body(proc.stdout) == body(shipped)
