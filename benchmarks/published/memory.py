"""Check anatomist's memory prediction on published GPU memory measurements, per regime. Never fitted.

    PYTHONPATH=src python benchmarks/published/memory.py check          # predict every row, print the table
    PYTHONPATH=src python benchmarks/published/memory.py check --json   # the errors per regime, as JSON
    PYTHONPATH=src python benchmarks/published/memory.py intervals      # write src/anatomist/data/memory_accuracy.toml

memory.toml holds one row per published measurement (a peak allocated, a peak reserved or an nvidia-smi
reading of one run), each with its source and the text it was read from. `check` estimates each run once
with the library (`estimate_memory`, as `anatomist estimate` does: the row's model, sequence length, recipe,
GPU and device count), compares the quantity each row measured, and prints the rows grouped by regime, then
the error per regime, per precision, per GPU generation and per quantity: n, min, median, max of the signed
error (predicted / measured - 1) and the median of its size.

Beside them, the Trainer steps anatomist's own GPU check ran on lent GPUs (benchmarks/gpu/<device>/bench.jsonl,
written by benchmarks/gpu/validate.sh; `gpu_rows`): each row's device total (the allocator's peak reserve plus what lay
outside it, nvidia-smi's figure), predicted again by this tree as benchmarks/gpu/repredict.py does. Never fitted
either, so their errors join the published ones in `intervals`.

Regimes, from the row's recipe: "one GPU, full fine-tune", "adapters (LoRA, QLoRA)" (on one GPU),
"sharded (FSDP2, ZeRO)", and "sharded, FSDP1 (not modelled)" for runs the source made with FSDP1, which
anatomist does not predict (it traces FSDP2): reported apart, never in the sharded figure.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROWS = HERE / "memory.toml"
CONFIGS = HERE / "configs"
QUANTITIES = ("peak_allocated", "peak_reserved", "device_total")
UNIT_BYTES = {"bytes": 1, "MiB": 2**20, "GiB": 2**30, "MB": 10**6, "GB": 10**9}
REGIMES = ("one GPU, full fine-tune", "adapters (LoRA, QLoRA)", "sharded (FSDP2, ZeRO)", "sharded, FSDP1 (not modelled)")
"""anatomist.estimate.intervals.MEMORY_REGIMES, and the FSDP1 runs apart."""


def load(path: Path = ROWS) -> dict[str, Any]:
    """memory.toml: its sources, rows and left-out entries."""
    return tomllib.loads(path.read_text())


def published_bytes(row: dict[str, Any]) -> int:
    """The row's published figure in bytes, converted exactly from its unit (a percentage of
    `percent_of_gib` GiB for "percent"), rounded to the byte."""
    if row["unit"] == "percent":
        return round(row["published"] / 100 * row["percent_of_gib"] * 2**30)
    return round(row["published"] * UNIT_BYTES[row["unit"]])


def regime(row: dict[str, Any]) -> str:
    """The row's regime, as the estimate names its own (`anatomist.estimate.intervals.memory_regime`), an FSDP1 run
    apart."""
    from anatomist.estimate.intervals import memory_regime
    from anatomist.recipe import Recipe

    if row.get("fsdp_version") == 1:
        return REGIMES[3]
    return memory_regime(Recipe.from_dict(row["recipe"], source=row["id"]), row["num_gpus"])[0]


def precision(row: dict[str, Any]) -> str:
    """The recipe's precision as a reader names it: the weights' dtype and the autocast, if any."""
    recipe = row["recipe"]
    weights = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[recipe.get("dtype", "float32")]
    autocast = "fp16" if recipe.get("fp16") else "bf16" if recipe.get("bf16") else None
    if recipe.get("load_in_4bit"):
        weights = "4-bit base"
    if autocast is None:
        return f"{weights} weights, no autocast"
    return f"{weights} weights, {autocast} autocast"


def generation(row: dict[str, Any]) -> str:
    """The GPU generation of the row's catalog GPU (the time model's data/time_generations.toml)."""
    from anatomist.calibration.lookup import generation_of_gpu

    return generation_of_gpu(row["gpu"])


def workload(row: dict[str, Any], folder: Path) -> Any:
    """The row's workload: a catalog model, or a config under configs/ (copied as `folder`/config.json)."""
    from anatomist.workload_loader import load_workload

    model = row["model"]
    config = CONFIGS / f"{model}.json"
    if config.is_file():
        (folder / "config.json").write_text(config.read_text())
        model = str(folder)
    return load_workload(model, seq_len=row["seq_len"], task=row["task"])


def predict(row: dict[str, Any]) -> dict[str, int]:
    """anatomist's peak allocated, peak reserved and device total (bytes) for the row's run."""
    from anatomist.estimate.memory import estimate_memory
    from anatomist.hardware import get_gpu
    from anatomist.recipe import Recipe

    with tempfile.TemporaryDirectory() as tmp:
        work = workload(row, Path(tmp))
        recipe = Recipe.from_dict(row["recipe"], source=row["id"]).resolved(work)
        anatomy = estimate_memory(work.for_recipe(recipe), recipe, get_gpu(row["gpu"]),
                                  num_gpus=row["num_gpus"]).anatomy
    return {q: int(getattr(anatomy, q)) for q in QUANTITIES}


def check(rows: list[dict[str, Any]], progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """Each row with its measured and predicted bytes and its error; one estimate per run."""
    predicted: dict[str, dict[str, int]] = {}
    out = []
    for row in rows:
        if row["run"] not in predicted:
            progress(row["run"])
            predicted[row["run"]] = predict(row)
        guess = predicted[row["run"]][row["quantity"]]
        out.append({**row, "regime": regime(row), "precision": precision(row), "generation": generation(row),
                    "measured_bytes": row["value_bytes"], "predicted_bytes": guess,
                    "error": guess / row["value_bytes"] - 1})
    return out


GPU_RUNS = HERE.parent / "gpu"
"""benchmarks/gpu: a folder per lent GPU that ran validate.sh, each with its bench.jsonl."""


def gpu_rows(folder: Path = GPU_RUNS, progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """The device total of every CUDA row that ran to the end in `folder`/<device>/bench.jsonl, with this tree's
    prediction and its error, as `check` gives a published row."""
    from anatomist.estimate.intervals import memory_regime
    from anatomist.recipe import Recipe

    sys.path.insert(0, str(folder))
    from repredict import cuda_rows, measured, predicted  # benchmarks/gpu/repredict.py

    out = []
    for path in sorted(folder.glob("*/bench.jsonl")):
        for row in cuda_rows(path):
            name = f"lent-{path.parent.name}/{row['name']}"
            progress(name)
            with tempfile.TemporaryDirectory() as tmp:
                guess = predicted(row, Path(tmp), time=False)
            recipe = {**{k: v for k, v in row["recipe"].items() if v is not None}, "dtype": guess["dtype"]}
            entry = {"id": name, "run": name, "quantity": "device_total", "num_gpus": 1, "gpu": guess["gpu"],
                     "recipe": recipe}
            value = int(measured(row)["device_total"])
            out.append({**entry, "regime": memory_regime(Recipe.from_dict(recipe, source=name), 1)[0],
                        "precision": precision(entry), "generation": generation(entry), "value_bytes": value,
                        "measured_bytes": value, "predicted_bytes": int(guess["device_total"]),
                        "error": guess["device_total"] / value - 1})
    return out


def summary(results: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """n, min, median, max of the signed errors, and the median of their size."""
    errors = [r["error"] for r in results]
    return {"n": len(errors), "min": min(errors), "median": statistics.median(errors), "max": max(errors),
            "median_abs": statistics.median(abs(e) for e in errors)}


def by(results: list[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    """`results` grouped by the value of `key`, regimes in REGIMES' order, other keys as they come."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(results, key=lambda r: REGIMES.index(r[key]) if key == "regime" else 0):
        groups.setdefault(r[key], []).append(r)
    return groups


def report(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The errors per regime (FSDP1 apart) and across them per precision, GPU generation and quantity
    (FSDP1 rows left out of those), each with its rows."""
    modelled = [r for r in results if r["regime"] != REGIMES[3]]
    out: dict[str, Any] = {}
    for axis, rows in (("regime", results), ("precision", modelled), ("generation", modelled), ("quantity", modelled)):
        out[axis] = {name: {**summary(group), "rows": [_row_json(r) for r in group]}
                     for name, group in by(rows, axis).items()}
    out["all modelled"] = summary(modelled)
    return out


def _row_json(r: dict[str, Any]) -> dict[str, Any]:
    return {"id": r["id"], "quantity": r["quantity"], "measured_bytes": r["measured_bytes"],
            "predicted_bytes": r["predicted_bytes"], "error": round(r["error"], 4)}


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f}"


def print_table(results: list[dict[str, Any]]) -> None:
    for name in REGIMES:
        group = [r for r in results if r["regime"] == name]
        if not group:
            continue
        print(f"\n## {name}\n")
        print("| row | GPU | precision | quantity | measured GiB | predicted GiB | error |")
        print("| --- | --- | --- | --- | ---: | ---: | ---: |")
        for r in group:
            print(f"| {r['id']} | {r['num_gpus']} x {r['gpu']} | {r['precision']} | {r['quantity']} | "
                  f"{_gib(r['measured_bytes'])} | {_gib(r['predicted_bytes'])} | {r['error']:+.1%} |")
    summaries = report(results)
    for axis, title in (("regime", "regime"), ("precision", "precision (FSDP1 rows left out)"),
                        ("generation", "GPU generation (FSDP1 rows left out)"),
                        ("quantity", "quantity (FSDP1 rows left out)")):
        print(f"\n## error per {title}\n")
        print("| | n | min | median | max | median size |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name, s in summaries[axis].items():
            print(f"| {name} | {s['n']} | {s['min']:+.1%} | {s['median']:+.1%} | {s['max']:+.1%} | {s['median_abs']:.1%} |")
    s = summaries["all modelled"]
    print(f"\nall modelled rows: n {s['n']}, median {s['median']:+.1%}, median size {s['median_abs']:.1%}, "
          f"from {s['min']:+.1%} to {s['max']:+.1%}")


def versions() -> str:
    """When and with what the check ran: the date, anatomist's commit and the libraries it traces with."""
    import datetime
    import importlib.metadata
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout
    libraries = []
    for name in ("torch", "transformers", "peft", "accelerate"):
        try:
            libraries.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            libraries.append(f"{name} not installed")
    return (f"{datetime.date.today().isoformat()}, anatomist at {commit.strip() or 'an unknown commit'}, "
            + ", ".join(libraries))


FITTING_QUANTITIES = ("device_total", "peak_reserved")
"""What decides whether a run fits: nvidia-smi's total, or the caching allocator's peak reserved (the same less the
CUDA context)."""
ACCURACY = Path(__file__).resolve().parents[2] / "src" / "anatomist" / "data" / "memory_accuracy.toml"


def accuracy_table(results: list[dict[str, Any]], measured: str) -> str:
    """data/memory_accuracy.toml's text: per regime, the errors of the rows that measured what decides fitting (FSDP1
    rows left out), their GPUs and rows; read by anatomist.estimate.intervals."""
    lines = ["# Written by `python benchmarks/published/memory.py intervals` (never by hand): the errors (predicted /",
             "# measured - 1) of anatomist's device total on the published GPU runs of benchmarks/published/memory.toml",
             "# that measured nvidia-smi's total or the peak reserved, and on the Trainer steps run on lent GPUs",
             "# (benchmarks/gpu/<device>/bench.jsonl, rows lent-<device>/...), per regime. anatomist.estimate.intervals reads it.",
             f'measured = "{measured}"', ""]
    for name, group in by([r for r in results if r["quantity"] in FITTING_QUANTITIES and r["regime"] != REGIMES[3]],
                          "regime").items():
        lines += [f'[regimes."{name}"]', "errors = [" + ", ".join(f"{r['error']:.4f}" for r in group) + "]",
                  "gpus = [" + ", ".join(f'"{g}"' for g in dict.fromkeys(r["gpu"] for r in group)) + "]",
                  "rows = [" + ", ".join(f'"{r["id"]}"' for r in group) + "]", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("check", "intervals"):
        raise SystemExit(__doc__)
    progress = lambda run: print(f"estimating {run}", file=sys.stderr, flush=True)  # noqa: E731
    results = check(load()["rows"], progress=progress) + gpu_rows(progress=progress)
    if argv[0] == "intervals":
        ACCURACY.write_text(accuracy_table(results, versions()))
        print(f"wrote {ACCURACY}", file=sys.stderr)
    elif "--json" in argv:
        print(json.dumps({"versions": versions(), **report(results)}, indent=1))
    else:
        print(f"# memory.py check: {versions()}")
        print_table(results)


if __name__ == "__main__":
    main(sys.argv[1:])
