"""Calibrate the time model on published measurements; write the shipped calibration.

    PYTHONPATH=src python benchmarks/published/fit.py components   # trace every run (minutes; cached)
    PYTHONPATH=src python benchmarks/published/fit.py fit          # fit, cross-validate, write the calibration

`components` traces each run of runs.toml (and the seeds' V100 check, checks.toml) on fake
tensors and stores, per run, the op components the time model needs (`time_fit.Components`) in
components.json: the fit, the cross-validation and the fast tests read that file instead of
tracing again (tests/test_time_published.py has a slow test that re-traces a sample and compares).

`fit` fits the factors per GPU generation (data/time_generations: which catalog GPUs form one) in
two stages: all five factors on every run (pooled), then the three efficiencies on the
generation's runs with the two overheads kept from the pooled fit. Every factor stays within the
bounds of what it physically is (estimate/time_model.py). The error it claims is
leave-one-source-out cross-validation: each source of a generation is predicted by a fit
(both stages) on every other source; for "any" (a GPU in no generation), each generation is
predicted by the pooled fit of the others. It writes src/anatomist/data/time_calibration.toml
and prints the cross-validation table that docs/time.md shows.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RUNS = HERE / "runs.toml"
CHECKS = HERE / "checks.toml"
COMPONENTS = HERE / "components.json"
CALIBRATION = HERE.parents[1] / "src" / "anatomist" / "data" / "time_calibration.toml"

def load_runs() -> list[dict[str, Any]]:
    from anatomist.estimate.published import load_runs as load

    return load(RUNS)


def load_checks() -> list[dict[str, Any]]:
    from anatomist.estimate.published import load_runs as load

    return load(CHECKS)


def _workload(run: dict[str, Any], folder: Path) -> Any:
    from anatomist.workload import load_workload

    model = run["model"]
    config = HERE / "configs" / f"{model}.json"
    if config.is_file():
        data = json.loads(config.read_text())
        data["n_positions"] = run["seq_len"]  # llm-foundry sets max_seq_len to the run's sequence length
        (folder / "config.json").write_text(json.dumps(data))
        model = str(folder)
    return load_workload(model, seq_len=run["seq_len"], task=run["task"])


def _recipe(run: dict[str, Any]) -> Any:
    """The recipe a run is traced as: its batch, accumulation, checkpointing and optimizer, the precision
    of the registry it names (axes/precisions.py) and the attention its code runs."""
    from anatomist.axes.precisions import precision
    from anatomist.recipe import Recipe

    return Recipe(per_device_train_batch_size=run["per_device_train_batch_size"],
                  gradient_accumulation_steps=run["gradient_accumulation_steps"],
                  gradient_checkpointing=run["gradient_checkpointing"], optim=run["optim"],
                  attn_implementation=run["attn_implementation"], **precision(run["precision"]).fields)


def run_components(run: dict[str, Any]) -> dict[str, Any]:
    """The stored inputs of one run: its components on its GPU (see time_fit.components)."""
    from anatomist.estimate.flops import step_ops
    from anatomist.estimate.time_fit import components
    from anatomist.hardware import get_gpu

    gpu = get_gpu(run["gpu"])
    with tempfile.TemporaryDirectory() as tmp:
        workload = _workload(run, Path(tmp))
        recipe = _recipe(run).resolved(workload)
        ops = step_ops(workload, recipe, gpu.compute_capability)
        share = 1.0 / run["num_gpus"] if run.get("sharding", "none") != "none" else 1.0
        return components(ops, recipe, gpu, optimizer_share=share).to_dict()


def cmd_components() -> None:
    from anatomist.estimate.published import run_key

    stored = json.loads(COMPONENTS.read_text()) if COMPONENTS.is_file() else {}
    todo = [(run_key(r), r) for r in load_runs() + load_checks()]
    todo.sort(key=lambda kv: "llm-foundry" in kv[1]["source"])  # the small models first
    for n, (key, run) in enumerate(todo):
        if key in stored:
            continue
        stored[key] = {"quote": run.get("quote"), "components": run_components(run)}
        print(f"[{n + 1}/{len(todo)}] {key}", file=sys.stderr, flush=True)
        COMPONENTS.write_text(json.dumps(stored, separators=(",", ":")))  # resumable
    keys = {key for key, _ in todo}
    COMPONENTS.write_text(json.dumps({k: v for k, v in stored.items() if k in keys}, separators=(",", ":")))


def cmd_fit() -> None:
    from anatomist.estimate.calibration import generation_of_gpu, published_toml
    from anatomist.estimate.published import cross_validate, fit_all, load_inputs

    inputs = load_inputs(load_runs(), json.loads(COMPONENTS.read_text()))
    generations = {g: sorted({r.gpu for r in inputs if generation_of_gpu(r.gpu) == g}) for g in
                   dict.fromkeys(generation_of_gpu(r.gpu) for r in inputs)}
    fitted = fit_all(inputs)
    cv = cross_validate(inputs)
    CALIBRATION.write_text(published_toml(fitted, cv))
    print("| generation | GPUs in the runs | runs | sources | median error | worst error | method |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for g, result in cv.items():
        print(f"| {g} | {', '.join(generations.get(g, [])) or 'all'} | {result.runs} | {result.sources} | "
              f"{result.median_error_pct:.1f}% | {result.worst_error_pct:.1f}% | {result.method} |")
    print_checks(fitted["V100"])


def print_checks(factors: Any) -> None:
    """The seeds' V100 check (checks.toml, never fitted): published and predicted samples/s per recipe,
    with the V100 generation's factors, fastest published first."""
    from anatomist.estimate.published import run_key
    from anatomist.estimate.time_fit import Components, predict

    stored = json.loads(COMPONENTS.read_text())
    print("\n| recipe | published | predicted | error |")
    print("| --- | ---: | ---: | ---: |")
    for check in sorted(load_checks(), key=lambda c: -c["samples_per_second"]):
        samples = check["per_device_train_batch_size"] * check["gradient_accumulation_steps"]
        predicted = samples / predict(Components.from_dict(stored[run_key(check)]["components"]), factors)
        print(f"| {check['name']} | {check['samples_per_second']:.2f} | {predicted:.2f} | "
              f"{predicted / check['samples_per_second'] - 1:+.0%} |")


if __name__ == "__main__":
    {"components": cmd_components, "fit": cmd_fit}[sys.argv[1]]()
