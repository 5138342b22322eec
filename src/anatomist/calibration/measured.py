"""A calibration fitted to steps measured on one GPU (`anatomist calibrate` on bench rows).

The published calibration (`calibration/published.py`) starts the fit; `fit.fit` moves each
factor within its bounds towards the measured step times.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from anatomist.calibration.fit import components, fit, relative_errors
from anatomist.calibration.lookup import Calibration, CalibrationError
from anatomist.calibration.published import PRIOR
from anatomist.estimate.time.ops import recomputed_kernels, step_ops
from anatomist.estimate.time.roofline import FACTOR_FIELDS, TIME_MODEL_VERSION
from anatomist.hardware import GPU
from anatomist.recipe import ResolvedRecipe
from anatomist.workload import Workload


@dataclass(frozen=True, slots=True)
class TimedStep:
    """A measured step for `fit_calibration`: what ran, where, and its seconds per optimizer step."""

    workload: Workload
    recipe: ResolvedRecipe
    gpu: GPU
    step_s: float


def fit_calibration(steps: list[TimedStep], *, source: str) -> Calibration:
    """The factors that best predict `steps` measured on one GPU (`anatomist calibrate`).

    All six factors are fitted (`fit.fit`, starting from the published PRIOR); an
    efficiency the steps cannot tell, and the overheads where there are fewer steps than factors,
    keep the prior's value. The result is a measured calibration for the steps' GPU, with the
    fit's own (in-sample) error.

    Raises:
        ValueError: no steps, or steps of several GPUs.
    """
    if not steps:
        raise ValueError("fit_calibration needs at least one measured step")
    gpus = {s.gpu.catalog_name for s in steps}
    if len(gpus) > 1:
        raise ValueError(f"fit_calibration fits one GPU at a time, got {sorted(gpus)}")
    comps = [components(step_ops(s.workload, s.recipe, s.gpu.compute_capability), s.recipe, s.gpu,
                        recomputed=recomputed_kernels(s.workload, s.recipe, s.gpu.compute_capability)) for s in steps]
    measured = [s.step_s for s in steps]
    factors, _ = fit(comps, measured, base=PRIOR)
    errors = abs(relative_errors(comps, measured, factors)) * 100
    return Calibration(
        calibrated=True, kind="measured", gpu=steps[0].gpu.catalog_name, source=source, factors=factors,
        error=CalibrationError(median_error_pct=float(np.median(errors)), worst_error_pct=float(errors.max()),
                               runs=len(steps), sources=1, method="in-sample"),
    )


def calibration_toml(cal: Calibration) -> str:
    """A measured calibration as a file (the format `load_calibration` reads)."""
    if cal.gpu is None:
        raise ValueError("a calibration file names the GPU it was measured on")
    lines = [
        "# Factors of anatomist's time model measured on one GPU (anatomist calibrate); see",
        "# anatomist/calibration/lookup.py for the lookup and the format.",
        f"time_model_version = {TIME_MODEL_VERSION}",
        f"gpu = {json.dumps(cal.gpu)}",
        f"source = {json.dumps(cal.source)}",
        *(f"{n} = {getattr(cal.factors, n)!r}" for n in FACTOR_FIELDS),
    ]
    if cal.error is not None:
        e = cal.error
        lines += ["", "[fit]", f"runs = {e.runs}", f"median_error_pct = {e.median_error_pct:.2f}",
                  f"worst_error_pct = {e.worst_error_pct:.2f}", f"method = {json.dumps(e.method)}"]
    return "\n".join(lines) + "\n"
