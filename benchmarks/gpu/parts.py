"""The five parts of the validation, each a list of resumable units (see runner.py).

  a  runtime overhead: how the host's issuing and the GPU's work overlap (overlap.py); CUDA context, cuBLAS / cuDNN /
     SDPA first use, allocator (overhead.py)
  b  `pytest -m gpu`: tests/test_gpu.py, one row per case (pytest_rows.py)
  c  `anatomist bench`: the suites of suites.toml, one row per unit: the guide's bert-large rows
     (seeds), the memory of today's LLM recipes (llama-1b.yaml), the suites other issues add
     (skipped with the reason while they do not exist)
  d  forward + backward alone over a grid of batch sizes and sequence lengths (fwd_bwd.py)
  e  `anatomist calibrate` on part c's rows: the time calibration of this device

Parts use the real command line (`python -m anatomist ...`) and fresh processes, as a user would.
Each unit has a priority (plan.py: 1 first, 2 then, 3 the rest) and its expected seconds on a GPU:
an estimate, worked out beside it, until a GPU measures it.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from results import quantity
from runner import Context, Finished, Outcome, Unit, run_child, timed_out

FWD_BWD_MODELS = ("bert-large-uncased", "gpt2", "Llama-3.2-1B")
"""An encoder (the seeds' model) and two decoders (learned positions, GQA + RoPE): catalog configs."""
FWD_BWD_GRID = {"batches": "1,4,16", "seq_lens": "128,512,1024,2048"}
FWD_BWD_WEIGHTS = ("bf16", "fp32-autocast")
"""fwd_bwd.py's weights modes: pure bf16 weights, and fp32 weights under bf16 autocast."""
DRY_RUN_LLAMA = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 512,
                 "max_position_embeddings": 64, "tie_word_embeddings": False}


def dry_run_llama(ctx: Context) -> Path:
    """A folder with DRY_RUN_LLAMA's config.json, under the dry run's results."""
    folder = ctx.out_dir / "configs" / "tiny-llama"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(DRY_RUN_LLAMA))
    return folder


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


def run_host_overlap(ctx: Context, unit: Unit, attempt: str, timeout_s: float) -> Outcome:
    cmd = [ctx.python, str(ctx.here / "overlap.py"), "--results", str(ctx.log.path), "--attempt", attempt,
           "--unit", unit.name]
    if ctx.dry_run:
        cmd += ["--model", str(dry_run_llama(ctx)), "--seq-len", "16", "--batches", "2", "--dry-run"]
    return child_outcome("overlap.py", run_child(cmd, ctx, timeout_s), unit, timeout_s)


def overhead_units(ctx: Context) -> list[Unit]:
    # Expected: a fresh Python importing torch and transformers (~6 s), CUDA's context and the first
    # cuBLAS / cuDNN / SDPA calls (~10 s), bert-base built at random and two training steps (~10 s), its
    # prediction traced on the CPU (~10 s), 8 allocator probes (~1 s): ~40 s, 60 s with room.
    # host-overlap first of all: the question the H200's Llama rows left open (overlap.py). Expected: a fresh Python
    # (~6 s), Llama-3.2-1B built at random on the GPU (~10 s), 6 settings of 5 timed and 2 profiled passes (~1 s
    # each, ~10 s with the profiler's start): ~30 s, 60 s with room.
    return [Unit(part="a", name="host-overlap", expected_s=60, cap_s=240, run=run_host_overlap, priority=1),
            Unit(part="a", name="overhead", expected_s=60, cap_s=300, run=run_overhead, priority=2)]


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
    # Expected: 15 cases, each a prediction of a 6-layer model (~4 s) and a fresh Python measuring two steps
    # on the GPU (~6 s), ~150 s, and pytest's start (~10 s).
    return [Unit(part="b", name="pytest-gpu", expected_s=180, cap_s=540, run=run_pytest)]


# -- c: anatomist bench -------------------------------------------------------------------------


def bench_row_to_quantities(row: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """A bench row's predicted vs measured figures, named with their units."""
    measured, predicted = row.get("measured") or {}, row.get("predicted") or {}
    mm, pm = measured.get("memory") or {}, predicted.get("memory") or {}
    out = {f"{k}_bytes": quantity(pm.get(k), mm.get(k)) for k in ("peak_allocated", "peak_reserved", "device_total")}
    out["samples_per_second"] = quantity((predicted.get("time") or {}).get("samples_per_second"),
                                         measured.get("samples_per_second"))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class SuiteHook:
    """One suite of suites.toml (its header says what each key means)."""

    name: str
    why: str = ""
    file: str | None = None
    priority: int = 3
    dry_run_rows: tuple[str, ...] = ()
    row_s: float = 45.0
    """A row's expected seconds on a GPU where suites.toml gives none: an estimate."""
    row_s_of: dict[str, float] = field(default_factory=dict)
    row_priority: dict[str, int] = field(default_factory=dict)
    """Rows whose priority is not the suite's."""

    def expected_s(self, row: str) -> float:
        return float(self.row_s_of.get(row, self.row_s))


HOOK_KEYS = {"name", "why", "file", "priority", "dry_run_rows", "row_s", "row_s_of", "row_priority"}


def suite_hooks(path: Path) -> list[SuiteHook]:
    """The suites of `path` (suites.toml), in its order.

    Raises:
        ValueError: an entry without a name, or with a key suites.toml does not describe.
    """
    hooks = []
    for i, entry in enumerate(tomllib.loads(path.read_text()).get("suite", []), start=1):
        unknown = sorted(set(entry) - HOOK_KEYS)
        if "name" not in entry or unknown:
            raise ValueError(f"{path}: suite {i} needs a name and takes only {', '.join(sorted(HOOK_KEYS))}"
                             + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        hooks.append(SuiteHook(name=str(entry["name"]), why=str(entry.get("why", "")), file=entry.get("file"),
                               priority=int(entry.get("priority", 3)),
                               dry_run_rows=tuple(entry.get("dry_run_rows", ())),
                               row_s=float(entry.get("row_s", 45.0)),
                               row_s_of={str(k): float(v) for k, v in entry.get("row_s_of", {}).items()},
                               row_priority={str(k): int(v) for k, v in entry.get("row_priority", {}).items()}))
    return hooks


def run_bench_row(ctx: Context, unit: Unit, attempt: str, timeout_s: float, *, suite: str, row: str) -> Outcome:
    cmd = [ctx.python, "-m", "anatomist", "bench", "--suite", suite, "--rows", row, "--resume",
           "--results", str(ctx.bench_results), "--json"]
    finished = run_child(cmd, ctx, timeout_s)
    if finished.returncode is None:
        return timed_out(unit, timeout_s)
    if finished.returncode != 0:
        return Outcome(status="error", note=f"anatomist bench exited with {finished.returncode}: "
                                            f"{finished.last_error_line()}")
    statuses = []
    for bench_row in json.loads(finished.stdout)["rows"]:
        status = bench_row["status"] if bench_row["status"] in ("ok", "oom", "error", "skipped") else "error"
        statuses.append((status, bench_row.get("reason")))
        ctx.log.row(part="c", unit=unit.name, attempt=attempt, name=unit.name, status=status, mode=ctx.mode,
                    reason=bench_row.get("reason"), quantities=bench_row_to_quantities(bench_row),
                    details={"recipe": bench_row.get("recipe"), "device": bench_row.get("device"),
                             "model": bench_row.get("model"), "notes": bench_row.get("notes"),
                             "time": (bench_row.get("measured") or {}).get("time"),
                             "cuda_context_bytes": (bench_row.get("measured") or {}).get("cuda_context_bytes")})
    if statuses and all(status == "skipped" for status, _ in statuses):
        # not run here (no CUDA, a package missing): its seconds say nothing of a real run (plan.py)
        return Outcome(status="skipped", note=statuses[0][1])
    return Outcome(status="ok")


def skipped_unit(part: str, name: str, reason: str, *, priority: int = 3) -> Unit:
    def run(ctx: Context, unit: Unit, attempt: str, timeout_s: float) -> Outcome:
        ctx.log.row(part=part, unit=name, attempt=attempt, name=name, status="skipped", mode=ctx.mode, reason=reason)
        return Outcome(status="skipped", note=reason)

    return Unit(part=part, name=name, expected_s=0, cap_s=60, run=run, priority=priority)


def bench_suite_units(hook: SuiteHook, source: str, rows: list[str]) -> list[Unit]:
    return [Unit(part="c", name=f"{hook.name}/{row}", expected_s=hook.expected_s(row), cap_s=300,
                 run=partial(run_bench_row, suite=source, row=row), priority=hook.row_priority.get(row, hook.priority))
            for row in rows]


def bench_units(ctx: Context) -> list[Unit]:
    from anatomist.bench.suites import load_suite, shipped_suites

    units = []
    for hook in suite_hooks(ctx.here / "suites.toml"):
        source = str(ctx.repo / hook.file) if hook.file else hook.name
        if not (Path(source).is_file() if hook.file else hook.name in shipped_suites()):
            units.append(skipped_unit("c", hook.name, f"suite {hook.name!r} ({hook.why}) does not exist in this "
                                                      "anatomist yet", priority=hook.priority))
        elif ctx.dry_run and not hook.dry_run_rows:
            units.append(skipped_unit("c", hook.name, f"dry-run: suite {hook.name!r} exists; its rows run on a GPU "
                                                      "only", priority=hook.priority))
        else:
            rows = list(hook.dry_run_rows) if ctx.dry_run else [r.name for r in load_suite(source).rows]
            units.extend(bench_suite_units(hook, source, rows))
    return units


# -- d: forward + backward alone ----------------------------------------------------------------


def fwd_bwd_units(ctx: Context) -> list[Unit]:
    """One unit per model and weights mode on a GPU (a few minutes each); one tiny model in a dry run."""
    if ctx.dry_run:
        grid = ["--batches", "2", "--seq-lens", "16", "--dry-run"]
        return [Unit(part="d", name="tiny-llama", expected_s=60, cap_s=300,
                     run=partial(run_fwd_bwd, model=str(dry_run_llama(ctx)), grid=grid))]
    grid = ["--batches", FWD_BWD_GRID["batches"], "--seq-lens", FWD_BWD_GRID["seq_lens"]]
    # Expected: a fresh Python (~6 s), the model built twice (one per attention kernel, ~5-10 s each), up to
    # 24 cells of 5 passes each (a few seconds in all on a GPU), and where predicted (fp32-autocast) one
    # estimate a cell (~4 s each once the first has filled the trace cache): ~120 s.
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
    # Expected: one time estimate per bench row (about 35 rows, ~2 s each from the trace cache the rows
    # filled) and the fit: ~90 s. It fits the rows part c has: it waits for them.
    return [Unit(part="e", name="calibrate", expected_s=90, cap_s=300, run=run_calibrate, after=("c",))]


PARTS = {
    "a": Part(name="a", title="runtime overhead (CUDA context, libraries, caching allocator)", units=overhead_units),
    "b": Part(name="b", title="pytest -m gpu (tests/test_gpu.py)", units=pytest_units),
    "c": Part(name="c", title="anatomist bench: the seeds' suite and the suites other issues add", units=bench_units),
    "d": Part(name="d", title="forward + backward alone: batch x sequence x attention grid", units=fwd_bwd_units),
    "e": Part(name="e", title="anatomist calibrate: the time model fitted to part c", units=calibrate_units),
}
