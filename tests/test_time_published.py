"""The time model's published calibration: its claimed error is the error held-back runs show,
the guide's V100 table, and the lookup that lets a GPU measurement win.

The fast tests read the op components benchmarks/published/fit.py stored per run
(components.json: tracing 150 published runs takes half an hour on 2 cores); the slow test
re-traces a sample and checks the stored components are what the tracer gives today.
"""

from __future__ import annotations

import json
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

from anatomist.calibration.fit import Components, predict
from anatomist.calibration.lookup import TIME_MODEL_VERSION, calibration_for, published, user_calibration_path
from anatomist.calibration.measured import calibration_toml
from anatomist.calibration.published import (
    Run,
    cross_validate,
    fit_generation,
    load_inputs,
    load_runs,
    measured_step_s,
    run_key,
)
from anatomist.estimate.intervals import time_accuracy
from anatomist.hardware import get_gpu

PUBLISHED = Path(__file__).parents[1] / "benchmarks" / "published"


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return load_runs(PUBLISHED / "runs.toml")


@pytest.fixture(scope="module")
def stored() -> dict:
    return json.loads((PUBLISHED / "components.json").read_text())


@pytest.fixture(scope="module")
def inputs(runs: list[dict], stored: dict) -> list[Run]:
    return load_inputs(runs, stored)


@pytest.fixture(scope="module")
def checks(stored: dict) -> list[Run]:
    return load_inputs(load_runs(PUBLISHED / "checks.toml"), stored)


def test_every_run_names_its_source_and_quote(runs: list[dict]) -> None:
    sources = {s["id"] for s in tomllib.loads((PUBLISHED / "runs.toml").read_text())["sources"]}
    assert {r["source"] for r in runs} == sources
    assert all(r["quote"] and get_gpu(r["gpu"]) for r in runs)
    # 7b, 2048 tokens, micro-batch 6 x 2 on A100 80GB at 4641 tokens/s/GPU: 6 * 2 * 2048 / 4641 = 5.296 s
    row = next(r for r in runs if r["quote"].startswith("|  7b | 2048 | 8 | a100_80gb | 64.23"))
    assert measured_step_s(row) == pytest.approx(6 * 2 * 2048 / 4641)


@pytest.mark.slow  # over 15 s on 2 cores
def test_a_held_back_source_is_predicted_within_the_claimed_error(inputs: list[Run]) -> None:
    """One fold, fast: Lambda's A100 runs predicted by a fit on every other source."""
    held = [r for r in inputs if r.source == "lambda-a100"]
    factors = fit_generation([r for r in inputs if r.source != "lambda-a100"], "A100")
    claim = published()["A100"].error
    assert claim is not None and held
    errors = [abs(predict(r.components, factors) / r.measured_s - 1) * 100 for r in held]
    assert max(errors) <= claim.worst_error_pct + 0.05


@pytest.mark.slow
def test_held_back_sources_are_predicted_within_the_claimed_error(inputs: list[Run], checks: list[Run]) -> None:
    """Each source, predicted by a fit that never saw it, is within the error the shipped calibration claims, per
    generation, and the time intervals' errors per generation and regime are this very cross-validation (a change of
    model or fit that moves them fails here)."""
    cv = cross_validate(inputs, checks)
    shipped = published()
    assert {g for g in cv if ": " not in g} == set(shipped)
    for name, result in cv.items():
        if ": " not in name:
            claim = shipped[name].error
            assert claim is not None and claim.runs == result.runs and claim.sources == result.sources, name
            assert result.median_error_pct <= claim.median_error_pct + 0.05, name
            assert max(abs(e) for e in result.errors.values()) * 100 <= claim.worst_error_pct + 0.05, name
        # what the time interval reads: the same signed errors, run by run (data/time_accuracy.toml)
        regime = time_accuracy()["regimes"][name if ": " in name else f"generation: {name}"]
        assert regime["runs"] == result.runs and regime["sources"] == result.sources, name
        assert regime["errors"] == pytest.approx([result.errors[k] for k in sorted(result.errors)], abs=1e-4), name


@pytest.mark.slow
def test_a_held_back_run_is_not_in_its_own_fit(inputs: list[Run]) -> None:
    """The cross-validation really holds a source back: refitting with it changes the factors."""
    source = inputs[0].source
    without = fit_generation([r for r in inputs if r.source != source], inputs[0].generation)
    with_it = fit_generation(inputs, inputs[0].generation)
    assert without != with_it


def _check_predictions(stored: dict) -> list[tuple[str, float, float]]:
    """(name, published samples/s, predicted samples/s) of every check, with the V100 calibration."""
    factors = published()["V100"].factors
    out = []
    for check in load_runs(PUBLISHED / "checks.toml"):
        samples = check["per_device_train_batch_size"] * check["gradient_accumulation_steps"]
        predicted = samples / predict(Components.from_dict(stored[run_key(check)]["components"]), factors)
        out.append((check["name"], check["samples_per_second"], predicted))
    return out


def test_the_guides_v100_table(stored: dict) -> None:
    """The guide's V100 recipes (never fitted), as docs/time.md reports them (time model 6). The six recipes the host
    does not bound: within 12% of their published speed (worst: adafactor, +5.6%) and their speed-ups over vanilla
    within 9% (adafactor, +8.4%). The three with checkpointing, fp16 and one sample per micro-batch, which the host
    bounds: within 31% (worst -29.7%, too slow): the 2022 Trainer's reentrant recomputation is priced as this
    machine's CPU measures it (REENTRANT_RECOMPUTE_HOST_WEIGHT, 1.2 forward kernels' worth), and the 2022 host
    issued kernels faster than that with the fitted 42 us per kernel says (on the H200 of benchmarks/gpu/H200, today's
    host, the same pricing gets checkpointing's cost right: tests/test_gpu_measured.py). The six ranked from fastest to
    slowest with a rank correlation of at least 0.95."""
    rows = _check_predictions(stored)
    _, vanilla_published, vanilla_predicted = next(r for r in rows if r[0] == "vanilla")
    for name, published_sps, predicted_sps in rows:
        host_bound = "checkpointing+fp16" in name
        assert abs(predicted_sps / published_sps - 1) < (0.31 if host_bound else 0.12), name
        speed_up = (predicted_sps / vanilla_predicted) / (published_sps / vanilla_published)
        assert abs(speed_up - 1) < (0.31 if host_bound else 0.09), name
    rows = [r for r in rows if "checkpointing+fp16" not in r[0]]
    published_order = [n for n, m, _ in sorted(rows, key=lambda r: -r[1])]
    predicted_order = [n for n, _, p in sorted(rows, key=lambda r: -r[2])]
    rank_p = {n: i for i, n in enumerate(published_order)}
    rank_q = {n: i for i, n in enumerate(predicted_order)}
    d = np.array([rank_p[n] - rank_q[n] for n in rank_p])
    spearman = 1 - 6 * float(d @ d) / (len(d) * (len(d) ** 2 - 1))
    assert spearman >= 0.95, (published_order, predicted_order)


# --- lookup: a GPU measurement wins -------------------------------------------------------------

MEASURED = {"tensor_core_efficiency": 0.5, "fp32_efficiency": 0.7, "bandwidth_efficiency": 0.6,
            "kernel_overhead_s": 6e-6, "micro_batch_overhead_s": 0.004, "host_op_s": 2e-5}


def _write(path: Path, gpu: str, version: int = TIME_MODEL_VERSION) -> Path:
    lines = [f"time_model_version = {version}", f'gpu = "{gpu}"', 'source = "a test"']
    lines += [f"{k} = {v!r}" for k, v in MEASURED.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_user_calibration_in_the_cache_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ANATOMIST_CACHE_DIR", str(tmp_path))
    a100 = get_gpu("A100-80GB")
    assert calibration_for(a100).kind == "published"  # nothing measured yet
    path = _write(user_calibration_path(a100), "A100-80GB")
    assert path == tmp_path / "calibration" / "A100-80GB.toml"
    cal = calibration_for(a100)
    assert cal.kind == "measured" and cal.factors.bandwidth_efficiency == 0.6 and str(path) in cal.describe()
    assert calibration_for(get_gpu("A100-40GB")).kind == "published"  # only for the GPU it was measured on
    assert calibration_toml(cal).startswith("#") and "micro_batch_overhead_s = 0.004" in calibration_toml(cal)


def test_estimate_says_which_calibration_it_used(cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({
        "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 64}))
    args = ("estimate", str(tmp_path / "m"), "--gpu", "A100-80GB", "--seq-len", "32", "--batch-size", "2")
    run = cli(*args)
    assert run.returncode == 0, run.stderr
    assert "published runs, A100 generation" in run.stdout and "leave-one-source-out" in run.stdout
    assert "UNCALIBRATED" not in run.stdout
    monkeypatch.setenv("ANATOMIST_CACHE_DIR", str(tmp_path / "cache"))
    _write(tmp_path / "cache" / "calibration" / "A100-80GB.toml", "A100-80GB")
    run = cli(*args)
    assert run.returncode == 0, run.stderr
    assert "time calibrated: measured: a test" in run.stdout


@pytest.mark.parametrize("content, message", [
    ("gpu = ", "not a calibration file"),
    (None, "measured on H100-SXM, not A100-80GB"),
    ("old", "time model version 3"),
    ("unphysical", "bandwidth_efficiency must be in [0.02, 1]"),
])
def test_bad_calibration_files_are_one_line_and_exit_2(cli, tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "cal.toml"
    if content is None:
        _write(path, "H100-SXM")
    elif content == "old":  # time model 3's file: no host time per kernel, phases never bound by the host
        _write(path, "A100-80GB", version=3)
    elif content == "unphysical":
        _write(path, "A100-80GB")
        path.write_text(path.read_text().replace("bandwidth_efficiency = 0.6", "bandwidth_efficiency = 8.0"))
    else:
        path.write_text(content)
    run = cli("estimate", "--gpu", "A100-80GB", "--calibration", str(path))
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert message in run.stderr


def test_a_malformed_user_calibration_is_refused_not_ignored(cli, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.setenv("ANATOMIST_CACHE_DIR", str(tmp_path))
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "V100-16GB.toml").write_text("not toml = = \n")
    run = cli("estimate", "--gpu", "V100-16GB")
    assert run.returncode == 2 and "not a calibration file" in run.stderr and run.stderr.count("\n") == 1


def test_the_lookup_is_a_table_read() -> None:
    gpu = get_gpu("H100-SXM")
    calibration_for(gpu)
    start = time.perf_counter()
    for _ in range(100):
        calibration_for(gpu)
    assert (time.perf_counter() - start) / 100 < 1e-3  # < 1 ms: nothing measurable beside an estimate


@pytest.mark.slow
def test_stored_components_are_what_the_tracer_gives(runs: list[dict], stored: dict) -> None:
    """Re-trace a sample (one run per source, the smallest model) and compare with components.json."""
    import sys

    sys.path.insert(0, str(PUBLISHED))
    from fit import run_components  # type: ignore[import-not-found]

    by_source: dict[str, dict] = {}
    for run in runs:
        by_source.setdefault(run["source"], run)
    for run in by_source.values():
        fresh = Components.from_dict(run_components(run))
        old = Components.from_dict(stored[run_key(run)]["components"])
        for name in ("tensor_core_s", "memory_s", "calls"):
            assert getattr(fresh, name).sum() == pytest.approx(getattr(old, name).sum(), rel=1e-3), (run_key(run), name)
