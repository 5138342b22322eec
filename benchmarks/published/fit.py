"""Calibrate the time model on published measurements; write the shipped calibration.

    PYTHONPATH=src python benchmarks/published/fit.py components   # trace every run (minutes; cached)
    PYTHONPATH=src python benchmarks/published/fit.py fit          # fit, cross-validate, write the calibration

`components` traces each run of runs.toml (and the seeds' V100 check, checks.toml) on fake
tensors and stores, per run, the op components the time model needs (`fit.Components`) in
components.json: the fit, the cross-validation and the fast tests read that file instead of
tracing again (tests/test_time_published.py has a slow test that re-traces a sample and compares).

`fit` fits the factors per GPU generation (data/time_generations: which catalog GPUs form one) in
two stages: five of the six factors on every run (pooled; the host time per micro-batch kept), then
the tensor-core and fp32 efficiencies on the generation's runs, the rest kept from the pooled fit.
Every factor stays within the bounds of what it physically is (estimate/time/roofline.py). The error it claims is
leave-one-source-out cross-validation: each source of a generation is predicted by a fit
(both stages) on every other source; for "any" (a GPU in no generation), each generation is
predicted by the pooled fit of the others. It writes src/anatomist/data/time_calibration.toml (the
factors and each generation's error) and src/anatomist/data/time_accuracy.toml (the signed held-out errors per
generation and per regime, which `estimate.intervals.time_interval` reads), and prints the factors, the cross-validation per generation and per regime, the guide's V100 check and
each source's held-out errors, the tables docs/time.md shows.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # loops.py beside this file
RUNS = HERE / "runs.toml"
CHECKS = HERE / "checks.toml"
COMPONENTS = HERE / "components.json"
CALIBRATION = HERE.parents[1] / "src" / "anatomist" / "data" / "time_calibration.toml"
ACCURACY = HERE.parents[1] / "src" / "anatomist" / "data" / "time_accuracy.toml"

def load_runs() -> list[dict[str, Any]]:
    from anatomist.calibration.published import load_runs as load

    return load(RUNS)


def load_checks() -> list[dict[str, Any]]:
    from anatomist.calibration.published import load_runs as load

    return load(CHECKS)


def _workload(run: dict[str, Any], folder: Path) -> Any:
    from anatomist.workload_loader import load_workload

    model = run["model"]
    config = HERE / "configs" / f"{model}.json"
    if config.is_file():
        data = json.loads(config.read_text())
        if data.get("model_type") == "gpt2":  # MPT as GPT-2: llm-foundry sets max_seq_len to the run's sequence length
            data["n_positions"] = run["seq_len"]
        (folder / "config.json").write_text(json.dumps(data))
        model = str(folder)
    return load_workload(model, seq_len=run["seq_len"], task=run["task"])


HALF_WEIGHTS = {"fp16-weights": {"dtype": "float16"}}
"""Precisions of published loops that no Trainer recipe has, as Recipe fields: weights loaded in float16 and
trained without autocast (the SDPA benchmark; the Trainer refuses --fp16 over float16 weights)."""


def _recipe(run: dict[str, Any]) -> Any:
    """The recipe a run is traced as: its batch, accumulation, checkpointing and optimizer, the precision
    of the registry it names (axes/precisions.py) and the attention its code runs."""
    from anatomist.axes.precisions import precision
    from anatomist.recipe import Recipe

    fields = HALF_WEIGHTS.get(run["precision"]) or precision(run["precision"]).fields
    return Recipe(per_device_train_batch_size=run["per_device_train_batch_size"],
                  gradient_accumulation_steps=run["gradient_accumulation_steps"],
                  gradient_checkpointing=run["gradient_checkpointing"], optim=run["optim"],
                  attn_implementation=run["attn_implementation"], **fields)


def run_ops(run: dict[str, Any], workload: Any, recipe: Any, compute_capability: str) -> Any:
    """The op records of one run's step, as its code ran it (`step`: loops.py)."""
    from loops import STEPS, apex_o2_ops, sdpa_benchmark_ops, trainer_2022_optimizer_ops

    from anatomist.anatomy import Phase
    from anatomist.estimate.time.ops import StepOps, step_ops

    step = run.get("step", "trainer")
    if step not in STEPS:
        raise ValueError(f"{run_key(run)}: unknown step {step!r}; known: {', '.join(STEPS)}")
    if step == "sdpa-benchmark":
        return sdpa_benchmark_ops(workload, recipe, compute_capability)
    if step == "apex-o2":
        return apex_o2_ops(workload, recipe, compute_capability)
    ops = step_ops(workload, recipe, compute_capability)
    if step == "trainer-2022":
        passes = [r for r in ops.records if r.phase is not Phase.OPTIMIZER]
        return StepOps(records=passes + trainer_2022_optimizer_ops(workload, recipe, compute_capability).records)
    return ops


def run_components(run: dict[str, Any]) -> dict[str, Any]:
    """The stored inputs of one run: its components on its GPU (see time_fit.components)."""
    from anatomist.calibration.fit import components
    from anatomist.estimate.time.ops import recomputed_kernels
    from anatomist.hardware import get_gpu

    gpu = get_gpu(run["gpu"])
    with tempfile.TemporaryDirectory() as tmp:
        workload = _workload(run, Path(tmp))
        recipe = _recipe(run).resolved(workload)
        ops = run_ops(run, workload, recipe, gpu.compute_capability)
        share = 1.0 / run["num_gpus"] if run.get("sharding", "none") != "none" else 1.0
        return components(ops, recipe, gpu, optimizer_share=share,
                          recomputed=recomputed_kernels(workload, recipe, gpu.compute_capability),
                          recompute_weight=recompute_weight(run)).to_dict()


def recompute_weight(run: dict[str, Any]) -> float:
    """The host's time per recomputed kernel of a run (`roofline.host_kernels`): the 2022 Trainer on torch 1.10
    checkpointed reentrantly, as torch did before 1.11; today's Trainer does not."""
    from anatomist.estimate.time.roofline import RECOMPUTE_HOST_WEIGHT, REENTRANT_RECOMPUTE_HOST_WEIGHT

    return REENTRANT_RECOMPUTE_HOST_WEIGHT if run.get("step") == "trainer-2022" else RECOMPUTE_HOST_WEIGHT


def run_key(run: dict[str, Any]) -> str:
    from anatomist.calibration.published import run_key as key

    return str(key(run))


def cmd_components() -> None:
    stored = json.loads(COMPONENTS.read_text()) if COMPONENTS.is_file() else {}
    todo = [(run_key(r), r) for r in load_runs() + load_checks()]
    todo.sort(key=lambda kv: "llm-foundry" in kv[1]["source"])  # the small models first
    for n, (key, run) in enumerate(todo):
        kept = stored.get(key, {}).get("components", {})
        # time model 3's have no phases, and time model 5's no recomputed kernels: traced again
        if "phase" in kept and ("recomputed" in kept or not _recipe(run).gradient_checkpointing):
            continue
        stored[key] = {"quote": run.get("quote"), "components": run_components(run)}
        print(f"[{n + 1}/{len(todo)}] {key}", file=sys.stderr, flush=True)
        COMPONENTS.write_text(json.dumps(stored, separators=(",", ":")))  # resumable
    keys = {key for key, _ in todo}
    COMPONENTS.write_text(json.dumps({k: v for k, v in stored.items() if k in keys}, separators=(",", ":")))


def cmd_fit() -> None:
    from anatomist.calibration.lookup import generation_of_gpu
    from anatomist.calibration.published import cross_validate, fit_all, load_inputs, published_toml

    stored = json.loads(COMPONENTS.read_text())
    inputs = load_inputs(load_runs(), stored)
    checks = load_inputs(load_checks(), stored)
    generations = {g: sorted({r.gpu for r in inputs if generation_of_gpu(r.gpu) == g}) for g in
                   dict.fromkeys(generation_of_gpu(r.gpu) for r in inputs)}
    fitted = fit_all(inputs)
    cv = cross_validate(inputs, checks)
    CALIBRATION.write_text(published_toml(fitted, cv))
    ACCURACY.write_text(accuracy_toml(cv, versions()))
    print("| factors | " + " | ".join(fitted) + " |")
    print("| --- |" + " ---: |" * len(fitted))
    for name in ("tensor_core_efficiency", "fp32_efficiency", "bandwidth_efficiency"):
        print(f"| {name} | " + " | ".join(f"{getattr(f, name):.3f}" for f in fitted.values()) + " |")
    for name, unit in (("kernel_overhead_s", 1e6), ("host_op_s", 1e6), ("micro_batch_overhead_s", 1e3)):
        print(f"| {name} ({'us' if unit == 1e6 else 'ms'}) | " + " | ".join(
            f"{getattr(f, name) * unit:.2f}" for f in fitted.values()) + " |")
    print("\n| generation or regime | GPUs in the runs | runs | sources | median error | worst error | 10th-90th pct | method |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- | --- |")
    for g, result in cv.items():
        print(f"| {g} | {', '.join(generations.get(g, [])) or ('all' if ': ' not in g else '')} | {result.runs} | "
              f"{result.sources} | {result.median_error_pct:.1f}% | {result.worst_error_pct:.1f}% | "
              f"{result.low_pct:+.1f}%..{result.high_pct:+.1f}% | {result.method} |")
    print_checks(fitted["V100"])
    print_sources(inputs, cv)


def versions() -> str:
    """When and with what the fit ran: the date, anatomist's commit and the libraries the runs were traced with."""
    import datetime
    import importlib.metadata
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "an unknown commit"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " with uncommitted changes"
    libraries = [f"{name} {importlib.metadata.version(name)}" for name in ("torch", "transformers")]
    return f"{datetime.date.today().isoformat()}, anatomist at {commit}, " + ", ".join(libraries)


def accuracy_toml(cv: dict[str, Any], measured: str) -> str:
    """data/time_accuracy.toml's text: per GPU generation ("generation: NAME", the runs of its cross-validation) and
    per regime ("precision: mixed", ...: the same held-out errors with the checks), the signed errors
    (predicted / measured - 1 of the step time) of runs predicted by a fit that never saw their source."""
    lines = ["# Written by `PYTHONPATH=src python benchmarks/published/fit.py fit` (never by hand): the signed errors",
             "# (predicted / measured - 1 of the step time) of the published runs of benchmarks/published/runs.toml,",
             "# each predicted by a fit that never saw its source (leave-one-source-out; 'generation: any':",
             "# each generation by a fit of the others), per GPU generation and per regime (the regimes also hold",
             "# checks.toml's runs, never fitted). anatomist.estimate.intervals reads it.",
             f"measured = {json.dumps(measured)}", ""]
    for name, c in cv.items():
        key = name if ": " in name else f"generation: {name}"
        keys = sorted(c.errors)
        sources = list(dict.fromkeys(k.rsplit("/", 1)[0] for k in keys))
        lines += [f"[regimes.{json.dumps(key)}]", "errors = [" + ", ".join(f"{c.errors[k]:.4f}" for k in keys) + "]",
                  f"runs = {c.runs}", f"sources = {c.sources}", f"method = {json.dumps(c.method)}",
                  "source_ids = [" + ", ".join(json.dumps(s) for s in sources) + "]", ""]
    return "\n".join(lines)


def print_checks(factors: Any) -> None:
    """The guide's V100 check (checks.toml, never fitted): published and predicted samples/s per recipe, and
    each recipe's speed-up over vanilla, with the V100 generation's factors, fastest published first."""
    from anatomist.calibration.fit import Components, predict

    stored = json.loads(COMPONENTS.read_text())
    rows = []
    for check in load_checks():
        samples = check["per_device_train_batch_size"] * check["gradient_accumulation_steps"]
        predicted = samples / predict(Components.from_dict(stored[run_key(check)]["components"]), factors)
        rows.append((check["name"], check["samples_per_second"], predicted))
    _, base_published, base_predicted = next(r for r in rows if r[0] == "vanilla")
    print("\n| recipe | published | predicted | error | speed-up published | predicted | error |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, published, predicted in sorted(rows, key=lambda r: -r[1]):
        up, up_predicted = published / base_published, predicted / base_predicted
        print(f"| {name} | {published:.2f} | {predicted:.2f} | {predicted / published - 1:+.1%} | {up:.2f}x | "
              f"{up_predicted:.2f}x | {up_predicted / up - 1:+.1%} |")


def print_sources(inputs: list[Any], cv: dict[str, Any]) -> None:
    """Each source's held-out errors (the leave-one-source-out predictions of its runs)."""
    held_out = {k: e for g, c in cv.items() if ": " not in g and g != "any" for k, e in c.errors.items()}
    print("\n| source | runs | median error | worst error | signed median |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for source in dict.fromkeys(r.source for r in inputs):
        errors = [held_out[r.key] for r in inputs if r.source == source]
        a = sorted(abs(e) for e in errors)
        print(f"| {source} | {len(errors)} | {a[len(a) // 2]:.1%} | {a[-1]:.1%} | {sorted(errors)[len(errors) // 2]:+.1%} |")


if __name__ == "__main__":
    {"components": cmd_components, "fit": cmd_fit}[sys.argv[1]]()
