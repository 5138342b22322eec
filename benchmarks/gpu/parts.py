"""The five parts of the validation, each a list of resumable units (see runner.py).

  a  runtime overhead: CUDA context, cuBLAS / cuDNN / SDPA first use, allocator (overhead.py)
  b  `pytest -m gpu`: tests/test_gpu.py, one row per case (pytest_rows.py)
  c  `anatomist bench`: the seeds' suite on bert-large-uncased, one row per unit, then the
     suites other issues add (suites.toml), skipped with the reason while they do not exist
  d  forward + backward alone over a grid of batch sizes and sequence lengths (fwd_bwd.py)
  e  `anatomist calibrate` on part c's rows: the time calibration of this device

Parts use the real command line (`python -m anatomist ...`) and fresh processes, as a user would.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from results import quantity
from runner import Context, Finished, Outcome, Unit, run_child, timed_out

SEEDS_DRY_RUN_ROWS = ("fp16",)
"""A dry run's seeds row: skipped on the CPU for needing CUDA, so the CLI, its --json rows and
their conversion run end to end without a worker (a CPU row takes ~30 s of a 2-core CPU and
is what tests/test_bench_cli.py covers; the conversion of measured figures is unit-tested)."""
FWD_BWD_MODELS = ("bert-large-uncased", "gpt2", "Llama-3.2-1B")
"""An encoder (the seeds' model) and two decoders (learned positions, GQA + RoPE): catalog configs."""
FWD_BWD_GRID = {"batches": "1,4,16", "seq_lens": "128,512,1024,2048"}
FWD_BWD_WEIGHTS = ("bf16", "fp32-autocast")
"""fwd_bwd.py's weights modes: pure bf16 weights, and fp32 weights under bf16 autocast."""
DRY_RUN_LLAMA = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 512,
                 "max_position_embeddings": 64, "tie_word_embeddings": False}


@dataclass(frozen=True, slots=True)
class Part:
    """A part of the validation: its letter, what it checks, and how to list its units."""

    name: str
    title: str
    units: Callable[[Context], list[Unit]]


def child_outcome(program: str, finished: Finished, unit: Unit, timeout_s: float) -> Outcome:
    """ok for exit 0; the unit's timeout or the program's last error line otherwise."""
    if finished.returncode is None:
        return timed_out(unit, timeout_s)
    if finished.returncode != 0:
        return Outcome(status="error", note=f"{program} exited with {finished.returncode}: {finished.last_error_line()}")
    return Outcome(status="ok")


# -- a: runtime overhead ------------------------------------------------------------------------


def run_overhead(ctx: Context, unit: Unit, attempt: str, timeout_s: float) -> Outcome:
    cmd = [ctx.python, str(ctx.here / "overhead.py"), "--results", str(ctx.log.path), "--attempt", attempt]
    finished = run_child(cmd + (["--dry-run"] if ctx.dry_run else []), ctx, timeout_s)
    return child_outcome("overhead.py", finished, unit, timeout_s)


def overhead_units(ctx: Context) -> list[Unit]:
    return [Unit(part="a", name="overhead", expected_s=60, cap_s=300, run=run_overhead)]


# -- b: pytest -m gpu ---------------------------------------------------------------------------


def run_pytest(ctx: Context, unit: Unit, attempt: str, timeout_s: float) -> Outcome:
    cmd = [ctx.python, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p", "pytest_rows"]
    env = ctx.child_env(VALIDATE_RESULTS=str(ctx.log.path), VALIDATE_ATTEMPT=attempt, VALIDATE_MODE=ctx.mode)
    finished = run_child(cmd, ctx, timeout_s, env=env)
    if finished.returncode is None:
        return timed_out(unit, timeout_s)
    if finished.returncode == 0:
        return Outcome(status="ok", note="every case passed or was skipped")
    if finished.returncode == 1:
        return Outcome(status="failed", note="some cases failed (see their rows)")
    if finished.returncode == 5:
        return Outcome(status="skipped", note="pytest collected no case")
    return Outcome(status="error", note=f"pytest exited with {finished.returncode}: {finished.last_error_line()}")


def pytest_units(ctx: Context) -> list[Unit]:
    return [Unit(part="b", name="pytest-gpu", expected_s=240, cap_s=540, run=run_pytest)]


# -- c: anatomist bench -------------------------------------------------------------------------


def bench_row_to_quantities(row: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """A bench row's predicted vs measured figures, named with their units."""
    measured, predicted = row.get("measured") or {}, row.get("predicted") or {}
    mm, pm = measured.get("memory") or {}, predicted.get("memory") or {}
    out = {f"{k}_bytes": quantity(pm.get(k), mm.get(k)) for k in ("peak_allocated", "peak_reserved", "device_total")}
    out["samples_per_second"] = quantity((predicted.get("time") or {}).get("samples_per_second"),
                                         measured.get("samples_per_second"))
    return out


def run_bench_row(ctx: Context, unit: Unit, attempt: str, timeout_s: float, *, suite: str, row: str) -> Outcome:
    cmd = [ctx.python, "-m", "anatomist", "bench", "--suite", suite, "--rows", row, "--resume",
           "--results", str(ctx.bench_results), "--json"]
    finished = run_child(cmd, ctx, timeout_s)
    if finished.returncode is None:
        return timed_out(unit, timeout_s)
    if finished.returncode != 0:
        return Outcome(status="error", note=f"anatomist bench exited with {finished.returncode}: "
                                            f"{finished.last_error_line()}")
    for bench_row in json.loads(finished.stdout)["rows"]:
        status = bench_row["status"] if bench_row["status"] in ("ok", "oom", "error", "skipped") else "error"
        ctx.log.row(part="c", unit=unit.name, attempt=attempt, name=unit.name, status=status, mode=ctx.mode,
                    reason=bench_row.get("reason"), quantities=bench_row_to_quantities(bench_row),
                    details={"recipe": bench_row.get("recipe"), "device": bench_row.get("device"),
                             "model": bench_row.get("model"), "notes": bench_row.get("notes"),
                             "time": (bench_row.get("measured") or {}).get("time"),
                             "cuda_context_bytes": (bench_row.get("measured") or {}).get("cuda_context_bytes")})
    return Outcome(status="ok")


def skipped_unit(part: str, name: str, reason: str) -> Unit:
    def run(ctx: Context, unit: Unit, attempt: str, timeout_s: float) -> Outcome:
        ctx.log.row(part=part, unit=name, attempt=attempt, name=name, status="skipped", mode=ctx.mode, reason=reason)
        return Outcome(status="skipped", note=reason)

    return Unit(part=part, name=name, expected_s=0, cap_s=60, run=run)


def bench_suite_units(ctx: Context, suite: str, rows: list[str]) -> list[Unit]:
    return [Unit(part="c", name=f"{suite}/{row}", expected_s=45, cap_s=300,
                 run=partial(run_bench_row, suite=suite, row=row)) for row in rows]


def bench_units(ctx: Context) -> list[Unit]:
    from anatomist.bench.suites import load_suite, shipped_suites

    seeds = [r.name for r in load_suite("seeds").rows]
    units = bench_suite_units(ctx, "seeds", list(SEEDS_DRY_RUN_ROWS) if ctx.dry_run else seeds)
    hooks = tomllib.loads((ctx.here / "suites.toml").read_text()).get("suite", [])
    for hook in hooks:
        name, why = str(hook["name"]), str(hook.get("why", ""))
        exists = name in shipped_suites() or (ctx.repo / name).is_file()
        if not exists:
            units.append(skipped_unit("c", name, f"suite {name!r} ({why}) does not exist in this anatomist yet"))
        elif ctx.dry_run:
            units.append(skipped_unit("c", name, f"dry-run: suite {name!r} exists; its rows run on a GPU only"))
        else:
            source = str(ctx.repo / name) if (ctx.repo / name).is_file() else name
            units.extend(bench_suite_units(ctx, name, [r.name for r in load_suite(source).rows]))
    return units


# -- d: forward + backward alone ----------------------------------------------------------------


def fwd_bwd_units(ctx: Context) -> list[Unit]:
    """One unit per model and weights mode on a GPU (a few minutes each); one tiny model in a dry run."""
    if ctx.dry_run:
        folder = ctx.out_dir / "configs" / "tiny-llama"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(DRY_RUN_LLAMA))
        grid = ["--batches", "2", "--seq-lens", "16", "--dry-run"]
        return [Unit(part="d", name="tiny-llama", expected_s=60, cap_s=300,
                     run=partial(run_fwd_bwd, model=str(folder), grid=grid))]
    grid = ["--batches", FWD_BWD_GRID["batches"], "--seq-lens", FWD_BWD_GRID["seq_lens"]]
    return [Unit(part="d", name=f"{model}/{weights}", expected_s=120, cap_s=420,
                 run=partial(run_fwd_bwd, model=model, grid=[*grid, "--weights", weights]))
            for model in FWD_BWD_MODELS for weights in FWD_BWD_WEIGHTS]


def run_fwd_bwd(ctx: Context, unit: Unit, attempt: str, timeout_s: float, *, model: str, grid: list[str]) -> Outcome:
    cmd = [ctx.python, str(ctx.here / "fwd_bwd.py"), "--model", model, "--unit", unit.name,
           "--results", str(ctx.log.path), "--attempt", attempt, *grid]
    return child_outcome("fwd_bwd.py", run_child(cmd, ctx, timeout_s), unit, timeout_s)


# -- e: anatomist calibrate ---------------------------------------------------------------------


def run_calibrate(ctx: Context, unit: Unit, attempt: str, timeout_s: float) -> Outcome:
    if not ctx.bench_results.is_file():
        reason = "no bench results: part c has not run"
        ctx.log.row(part="e", unit="calibrate", attempt=attempt, name="calibrate", status="skipped",
                    mode=ctx.mode, reason=reason)
        return Outcome(status="skipped", note=reason)
    output = ctx.out_dir / "time-calibration.toml"
    # --install: on this machine, estimate and plan then use the measured factors, not the published ones
    cmd = [ctx.python, "-m", "anatomist", "calibrate", str(ctx.bench_results), "-o", str(output), "--install", "--json"]
    finished = run_child(cmd, ctx, timeout_s)
    if finished.returncode is None:
        return timed_out(unit, timeout_s)
    if finished.returncode == 2:  # bad input: here, no GPU rows to fit (a dry run) or an unknown GPU
        reason = f"anatomist calibrate: {finished.last_error_line()}"
        ctx.log.row(part="e", unit="calibrate", attempt=attempt, name="calibrate", status="skipped",
                    mode=ctx.mode, reason=reason)
        return Outcome(status="skipped", note=reason)
    if finished.returncode != 0:
        return Outcome(status="error", note=f"anatomist calibrate exited with {finished.returncode}: "
                                            f"{finished.last_error_line()}")
    result = json.loads(finished.stdout)
    ctx.log.row(part="e", unit="calibrate", attempt=attempt, name="calibration", status="ok", mode=ctx.mode,
                details={"gpu": result["gpu"], "calibration": result["calibration"], "file": output.name})
    for r in result["rows"]:
        ctx.log.row(part="e", unit="calibrate", attempt=attempt, name=f"fit/{r['name']}", status="ok",
                    mode=ctx.mode, quantities={"step_s": quantity(r["fitted_step_s"], r["measured_step_s"])},
                    details={"note": "predicted = the fitted (calibrated) step time"})
    return Outcome(status="ok")


def calibrate_units(ctx: Context) -> list[Unit]:
    return [Unit(part="e", name="calibrate", expected_s=30, cap_s=180, run=run_calibrate)]


PARTS = {
    "a": Part(name="a", title="runtime overhead (CUDA context, libraries, caching allocator)", units=overhead_units),
    "b": Part(name="b", title="pytest -m gpu (tests/test_gpu.py)", units=pytest_units),
    "c": Part(name="c", title="anatomist bench: the seeds' suite and the suites other issues add", units=bench_units),
    "d": Part(name="d", title="forward + backward alone: batch x sequence x attention grid", units=fwd_bwd_units),
    "e": Part(name="e", title="anatomist calibrate: the time model fitted to part c", units=calibrate_units),
}
