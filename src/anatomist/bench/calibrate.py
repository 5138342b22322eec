"""Fit the time model to `anatomist bench` rows measured on a GPU: `anatomist calibrate`.

Each finished GPU row gives a measured step (its median optimizer-step time, from the
callback) of a known workload, recipe and GPU; `calibration.measured.fit_calibration` finds the
factors that predict them best. The result is a measured calibration for that GPU (and
software stack): a file for `--calibration FILE`, or, installed, the user's calibration of that
GPU that estimate and plan then use by default (`calibration.lookup.calibration_for`).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anatomist.bench.store import open_results
from anatomist.calibration.lookup import Calibration
from anatomist.calibration.measured import TimedStep, fit_calibration
from anatomist.errors import InputError
from anatomist.estimate.time.device import estimate_time
from anatomist.hardware import match_catalog
from anatomist.recipe import Recipe
from anatomist.workload import Workload
from anatomist.workload_loader import load_workload


@dataclass(kw_only=True, slots=True)
class Calibrated:
    calibration: Calibration
    gpu: str
    rows: list[dict[str, Any]]
    """Per row used: name, measured and fitted step seconds, error %."""


def row_workload(spec: dict[str, Any], folder: Path) -> Workload:
    """The workload of a bench row's `workload` field (its config written to `folder` where the row carries one)."""
    model = spec["model"]
    if spec.get("model_config"):
        (folder / "config.json").write_text(json.dumps(spec["model_config"]))
        model = str(folder)
    return load_workload(model, seq_len=int(spec["seq_len"]), task=spec.get("task", "sequence-classification"))


def calibrate(results: str | Path | None, *, records: str | Path | None = None) -> Calibrated:
    """Fit the roofline factors to the finished GPU rows of a bench results file and/or the run
    records AnatomistCallback and track() keep (`records`: a runs.jsonl, `anatomist.measure.run_log`).

    Raises:
        InputError: not a results file, no finished GPU row with a step time (CPU rows cannot
            calibrate a GPU), rows from more than one GPU, or a GPU the catalog lacks.
    """
    # run records are bench rows (same keys), read after the results file's
    rows = list(open_results(results, create=False).rows) if results is not None else []
    if records is not None:
        from anatomist.measure.run_log import read_records

        rows += read_records(records)
    named = results if results is not None else records
    if named is None:
        raise InputError("calibrate needs a bench results file or run records")
    results = named
    steps: list[TimedStep] = []
    names: list[str] = []
    with tempfile.TemporaryDirectory(prefix="anatomist-calibrate-") as tmp:
        for i, row in enumerate(rows):
            device = row.get("device") or {}
            step_s = ((row.get("measured") or {}).get("time") or {}).get("median_step_s")
            if row["status"] != "ok" or device.get("kind") != "cuda" or not step_s or not row.get("workload"):
                continue
            gpu = match_catalog(str(device.get("name", "")), int(device.get("memory_bytes") or 0))
            if gpu is None:
                raise InputError(f"{results}: row {row['name']!r} ran on {device.get('name')!r}, which the GPU catalog "
                                 "does not know (anatomist gpus)")
            folder = Path(tmp, str(i))
            folder.mkdir()
            workload = row_workload(row["workload"], folder)
            steps.append(TimedStep(workload=workload, recipe=Recipe.from_dict(row["recipe"]).resolved(workload),
                                   gpu=gpu, step_s=float(step_s)))
            names.append(row["name"])
        if not steps:
            raise InputError(f"{results}: no finished GPU row with a step time; calibration needs `anatomist bench` "
                             "run on the GPU to calibrate (rows measured on a CPU say nothing about a GPU)")
        gpus = sorted({s.gpu.name for s in steps})
        if len(gpus) > 1:
            raise InputError(f"{results}: rows from several GPUs ({', '.join(gpus)}); calibrate one GPU at a time")
        cal = fit_calibration(steps, source=f"anatomist calibrate: {len(steps)} bench rows of {Path(results).name} "
                                            f"on {gpus[0]}")
        rows = []
        for name, s in zip(names, steps, strict=True):
            fitted = estimate_time(s.workload, s.recipe, s.gpu, cal).step_s
            rows.append({"name": name, "measured_step_s": s.step_s, "fitted_step_s": fitted,
                         "error_pct": (fitted - s.step_s) / s.step_s * 100})
    return Calibrated(calibration=cal, gpu=gpus[0], rows=rows)
