"""`anatomist calibrate`: fit the time model to bench rows, and use it with --calibration.

No GPU here, so the GPU rows below are SYNTHETIC: their step times are made by the time
model itself with known factors (grid points of the fit), and the test checks that the
calibration gives those factors back through the whole path (results file -> workloads ->
fit -> calibration file -> estimate). Real CPU rows must be refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from anatomist.bench.calibrate import calibrate
from anatomist.calibration.fit import COARSE as EFFICIENCY_GRID
from anatomist.calibration.lookup import load_calibration, published
from anatomist.errors import InputError
from anatomist.estimate.time.device import estimate_time
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.workload_loader import load_workload

FIXTURES = Path(__file__).parent / "fixtures"
# BERT-large-sized blocks: some matrix products are compute-bound at the true factors. With hidden 256
# every op is memory-bound on an H100, and a lower tensor-core efficiency with a higher bandwidth one
# predicts the same step times exactly: the factors could not be told apart, whatever the fit.
CONFIG = {
    "model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16,
    "intermediate_size": 4096, "vocab_size": 1000, "max_position_embeddings": 256, "type_vocab_size": 2,
}
H100 = {"name": "NVIDIA H100 80GB HBM3", "kind": "cuda", "memory_bytes": 85_520_809_984}
TRUTH = dataclasses.replace(published()["H100"], factors=published()["H100"].factors.replace(
    tensor_core_efficiency=float(EFFICIENCY_GRID[18]), bandwidth_efficiency=float(EFFICIENCY_GRID[20]),
    kernel_overhead_s=4e-6, micro_batch_overhead_s=2e-3, host_op_s=1e-6,  # a fast host: the GPU bounds every phase
))


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("calibrate")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    workload = load_workload(str(folder), seq_len=128, task="sequence-classification")
    gpu = get_gpu("H100-SXM")
    lines = [json.dumps({"anatomist_results": 1})]
    # Five factors to fit (tensor-core and bandwidth efficiencies, three overheads): seven rows, one accumulating
    # (it tells the host time per micro-batch from the per-kernel overhead).
    for name, recipe in {"bs1": Recipe(per_device_train_batch_size=1, bf16=True),
                         "bs16": Recipe(per_device_train_batch_size=16, bf16=True),
                         "bs8-ckpt": Recipe(per_device_train_batch_size=8, bf16=True, gradient_checkpointing=True),
                         "bs2x4": Recipe(per_device_train_batch_size=2, gradient_accumulation_steps=4, bf16=True),
                         "bs4": Recipe(per_device_train_batch_size=4, bf16=True),
                         "bs32": Recipe(per_device_train_batch_size=32, bf16=True),
                         "bs2-ckpt": Recipe(per_device_train_batch_size=2, bf16=True, gradient_checkpointing=True),
                         "oom": Recipe(per_device_train_batch_size=64)}.items():
        step_s = estimate_time(workload, recipe.resolved(workload), gpu, TRUTH).step_s
        lines.append(json.dumps({
            "name": name, "model": "synthetic", "recipe": recipe.to_dict(), "device": H100, "versions": {},
            "status": "oom" if name == "oom" else "ok", "reason": None, "predicted": {}, "error_pct": {},
            "workload": {"model": None, "model_config": CONFIG, "seq_len": 128, "task": "sequence-classification"},
            "measured": {} if name == "oom" else {"time": {"median_step_s": step_s, "steps": 10}},
        }))
    path = folder / "synthetic-h100.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_calibration_recovers_the_factors_from_a_results_file(gpu_results: Path) -> None:
    result = calibrate(gpu_results)
    cal = result.calibration
    assert result.gpu == "H100-SXM" and [r["name"] for r in result.rows] == ["bs1", "bs16", "bs8-ckpt", "bs2x4", "bs4", "bs32",
                                                                    "bs2-ckpt"]  # not the OOM
    assert cal.calibrated and "7 bench rows" in cal.source
    assert cal.factors.tensor_core_efficiency == pytest.approx(TRUTH.factors.tensor_core_efficiency)
    assert cal.factors.bandwidth_efficiency == pytest.approx(TRUTH.factors.bandwidth_efficiency)
    assert cal.factors.kernel_overhead_s == pytest.approx(4e-6, rel=1e-3)
    assert cal.factors.micro_batch_overhead_s == pytest.approx(2e-3, rel=1e-3)
    assert all(abs(r["error_pct"]) < 0.1 for r in result.rows)


@pytest.mark.slow
def test_cli_writes_a_calibration_that_estimate_and_plan_use(cli, gpu_results: Path, tmp_path: Path) -> None:
    out = tmp_path / "h100.toml"
    run = cli("calibrate", str(gpu_results), "-o", str(out))
    assert run.returncode == 0, run.stderr
    assert "bs16" in run.stdout and load_calibration(out).calibrated and "measured" in load_calibration(out).source
    model = gpu_results.parent
    est = cli("estimate", str(model), "--gpu", "H100-SXM", "--bf16", "--seq-len", "128", "--batch-size", "4",
              "--calibration", str(out), "--json")
    assert est.returncode == 0, est.stderr
    time = json.loads(est.stdout)["time"]
    assert time["calibrated"] is True and time["calibration"].startswith("time calibrated: measured")
    workload = load_workload(str(model), seq_len=128)
    expected = estimate_time(workload, Recipe(per_device_train_batch_size=4, bf16=True).resolved(workload), get_gpu("H100-SXM"), TRUTH)
    assert time["step_s"] == pytest.approx(expected.step_s, rel=1e-6)


def test_cpu_rows_and_bad_files_are_refused(cli, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no finished GPU row"):
        calibrate(FIXTURES / "bench_cpu_seeds.jsonl")
    run = cli("calibrate", str(FIXTURES / "bench_cpu_seeds.jsonl"))
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("calibrated = true\n")
    with pytest.raises(InputError, match="missing"):
        load_calibration(bad)
    run = cli("estimate", "--calibration", str(bad))
    assert run.returncode == 2 and "not a calibration file" in run.stderr
    plan = tmp_path / "plan.json"
    plan.write_text('{"model": "gpt2"}\n')
    run = cli("calibrate", str(plan))  # calibrate has no --results: the bench's advice is not given
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"anatomist: error: {plan}: not an anatomist results file (line 1 is not its header) (`anatomist bench` writes one)"]
