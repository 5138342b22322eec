"""The time model's calibration: which factors a prediction uses, where they come from, and the
error they are known to have.

Lookup, for a target GPU (`calibration_for`), first found wins:

1. `--calibration FILE` (a measured calibration, as `anatomist calibrate -o FILE` writes it);
2. the user's measured calibration for that GPU: `<cache>/calibration/<GPU name>.toml`, where
   `<cache>` is $ANATOMIST_CACHE_DIR, else platformdirs' user_cache_dir("anatomist") (the trace
   cache's root); `anatomist calibrate RESULTS --install` and benchmarks/gpu/validate.sh write it;
3. a measured calibration shipped with anatomist for that GPU: data/measured/<GPU name>.toml
   (committed GPU results; none yet);
4. the published calibration of the GPU's generation (data/time_calibration.toml, fitted by
   benchmarks/published/fit.py to published training runs), with its cross-validated error;
5. the published "any" calibration (all generations pooled) for a GPU in no generation.

A measured file holds one GPU's factors:

    time_model_version = 6
    gpu = "A100-80GB"                      # the catalog name; another GPU's file is refused
    source = "anatomist calibrate: 12 bench rows of bench.jsonl on A100-80GB"
    tensor_core_efficiency = 0.61          # the six factors of estimate/time/roofline.py, in their bounds
    fp32_efficiency = 0.8
    bandwidth_efficiency = 0.55
    kernel_overhead_s = 4.2e-06
    micro_batch_overhead_s = 0.002
    host_op_s = 2.5e-05
    [fit]                                  # optional: the in-sample error of that fit
    runs = 12
    median_error_pct = 3.1
    worst_error_pct = 7.9

Known limitations: a measured calibration is trusted for the GPU it names whatever software stack
measured it; its error is the fit's own (in-sample), not cross-validated.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from anatomist.errors import InputError
from anatomist.estimate.time.roofline import FACTOR_FIELDS, TIME_MODEL_VERSION, Factors
from anatomist.hardware import GPU

ANY_GENERATION = "any"


@dataclass(kw_only=True, slots=True, frozen=True)
class CalibrationError:
    """How far predictions with a calibration were from measured steps, in percent of the measured."""

    median_error_pct: float
    worst_error_pct: float
    runs: int
    sources: int
    method: str
    """leave-one-source-out, leave-one-generation-out, or in-sample (a measured fit)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Calibration:
    """The factors of the time model (estimate/time/roofline.py) and where they come from."""

    calibrated: bool
    """True when the factors were fitted to measured steps (published or the user's own)."""
    source: str
    """Where the factors come from, in words (printed with every time figure)."""
    kind: Literal["published", "measured", "placeholder"] = "placeholder"
    gpu: str | None = None
    """The catalog GPU a measured calibration was fitted on (None: a generation's)."""
    generation: str | None = None
    factors: Factors
    error: CalibrationError | None = None
    """How far predictions with these factors were from measured steps (None: not known)."""

    def describe(self) -> str:
        """One line for the output: what was used and how good it is known to be."""
        if not self.calibrated:
            return f"time factors UNCALIBRATED ({self.source})"
        if self.error is None:
            return f"time calibrated: {self.source}"
        e = self.error
        return (f"time calibrated: {self.source}; +-{e.median_error_pct:.0f}% median, {e.worst_error_pct:.0f}% worst "
                f"({e.method} over {e.runs} runs from {e.sources} source{'s' if e.sources != 1 else ''})")


def _factors(raw: dict[str, Any], where: str) -> Factors:
    missing = [n for n in FACTOR_FIELDS if n not in raw]
    if missing:
        raise InputError(f"{where}: not a calibration file (missing {', '.join(missing)}); write one with "
                         "`anatomist calibrate`")
    values = {n: raw[n] for n in FACTOR_FIELDS}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values.values()):
        raise InputError(f"{where}: calibration factors must be numbers")
    try:
        return Factors(**{n: float(v) for n, v in values.items()})
    except ValueError as exc:
        raise InputError(f"{where}: {exc}") from None


def _check_version(raw: dict[str, Any], where: str) -> None:
    version = raw.get("time_model_version")
    if version != TIME_MODEL_VERSION:
        raise InputError(f"{where}: calibration for time model version {version!r}, this anatomist's is "
                         f"{TIME_MODEL_VERSION}; fit it again with `anatomist calibrate`")


def _error(raw: dict[str, Any] | None, method: str) -> CalibrationError | None:
    if not raw:
        return None
    return CalibrationError(median_error_pct=float(raw["median_error_pct"]), worst_error_pct=float(raw["worst_error_pct"]),
                            runs=int(raw["runs"]), sources=int(raw.get("sources", 1)), method=str(raw.get("method", method)))


def load_calibration(path: str | Path, gpu: GPU | None = None) -> Calibration:
    """A measured calibration file (`anatomist calibrate -o FILE`), checked against `gpu`.

    Raises:
        InputError: missing, not TOML, without the factors, of another time-model version, or
            fitted on another GPU than `gpu`.
    """
    p = Path(path)
    try:
        text = p.read_text()
        raw = tomllib.loads(text)
    except FileNotFoundError:
        raise InputError(f"calibration file {str(p)!r} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, IsADirectoryError) as exc:
        raise InputError(f"{p}: not a calibration file ({exc})") from None
    if not raw:  # nothing but blanks and comments
        raise InputError(f"calibration file {str(p)!r} is empty")
    if "time_model_version" in raw:  # another version's factors have other names or meanings: say that first
        _check_version(raw, str(p))
    factors = _factors(raw, str(p))
    _check_version(raw, str(p))
    fitted_on = raw.get("gpu")
    if not isinstance(fitted_on, str):
        raise InputError(f"{p}: not a calibration file (no gpu = \"NAME\"); write one with `anatomist calibrate`")
    if gpu is not None and fitted_on != gpu.catalog_name:
        raise InputError(f"{p}: calibration measured on {fitted_on}, not {gpu.catalog_name}; calibrate {gpu.catalog_name} "
                         "or leave --calibration out to use the published one")
    return Calibration(calibrated=True, kind="measured", gpu=fitted_on, source=f"measured: {raw.get('source', p)} ({p})",
                       error=_error(raw.get("fit"), "in-sample"), factors=factors)


# --- published (shipped) calibration -----------------------------------------------------------

@cache
def generations() -> dict[str, tuple[str, ...]]:
    """Generation name -> the catalog GPUs it covers (data/time_generations.toml)."""
    raw = tomllib.loads(resources.files("anatomist.data").joinpath("time_generations.toml").read_text())
    return {name: tuple(spec["gpus"]) for name, spec in raw["generations"].items()}


def generation_of_gpu(name: str) -> str:
    """The generation whose published factors a GPU uses ("any" when it is in none)."""
    return next((g for g, gpus in generations().items() if name in gpus), ANY_GENERATION)


@cache
def _published_raw() -> dict[str, Any]:
    raw = tomllib.loads(resources.files("anatomist.data").joinpath("time_calibration.toml").read_text())
    _check_version(raw, "data/time_calibration.toml")
    return raw


@cache
def published() -> dict[str, Calibration]:
    """The shipped calibration per generation (data/time_calibration.toml)."""
    raw = _published_raw()
    out = {}
    for name, spec in raw["generations"].items():
        out[name] = Calibration(
            calibrated=True, kind="published", generation=name,
            source=f"published runs, {name} generation" if name != ANY_GENERATION else "published runs, all generations",
            error=_error(spec.get("cross_validation"), "leave-one-source-out"), factors=_factors(spec, f"generation {name}"))
    return out


def user_calibration_path(gpu: GPU) -> Path:
    """`<cache>/calibration/<GPU name>.toml` (the cache root: $ANATOMIST_CACHE_DIR or the user cache)."""
    root = os.environ.get("ANATOMIST_CACHE_DIR")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("anatomist", appauthor=False)
    return Path(root) / "calibration" / f"{gpu.catalog_name}.toml"


def calibration_for(gpu: GPU, path: str | Path | None = None) -> Calibration:
    """The calibration a prediction on `gpu` uses (the lookup order of the module docstring).

    Raises:
        InputError: `path`, the user's file or a shipped measured file is unreadable, of
            another time-model version, or for another GPU.
    """
    if path is not None:
        return load_calibration(path, gpu)
    user = user_calibration_path(gpu)
    if user.is_file():
        return load_calibration(user, gpu)
    shipped = resources.files("anatomist.data").joinpath("measured", f"{gpu.catalog_name}.toml")
    if shipped.is_file():
        return load_calibration(Path(str(shipped)), gpu)
    tables = published()
    return tables.get(generation_of_gpu(gpu.catalog_name)) or tables[ANY_GENERATION]
