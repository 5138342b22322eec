"""What `AnatomistCallback` and `track()` share around a run: the pre-flight before it, and after
its first steps the measured peaks and step time beside the prediction, kept as a run record.

A prediction that cannot be made (no tokens per sample, no GPU named or found, an architecture
or a setting anatomist does not model) is said in one line and the run goes on; only "refuse"
(and "fit" with nothing that fits) stops it, with `PreflightRefused`.
"""

from __future__ import annotations

import datetime
import logging
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN
from anatomist.errors import InputError
from anatomist.hardware import GPU
from anatomist.measure.monitor import allocator_stats, device_snapshot
from anatomist.measure.preflight import (
    BelowWeights,
    Preflight,
    PreflightRefused,
    check_mode,
    preflight,
    target_gpu,
)

if TYPE_CHECKING:
    from anatomist.estimate.predict import Estimate
    from anatomist.measure.recorder import Recorder
    from anatomist.recipe import Recipe
    from anatomist.workload import Workload

logger = logging.getLogger("anatomist")


RANK_VARIABLE = "RANK"
"""The global rank torchrun and `accelerate launch` give each process (unset: a single process)."""


def is_rank_zero() -> bool:
    """Whether this is the first process of a distributed run (or the only one)."""
    return os.environ.get(RANK_VARIABLE, "0") == "0"


class Watch:
    """The pre-flight and the run record of one run.

    Args:
        mode: "warn", "refuse", "fit" (`preflight.PREFLIGHT_MODES`) or None (no pre-flight, no record).
        gpu: the GPU to predict for (a catalog name); None: the one NVML finds.
        limit_bytes: an explicit memory budget for the device total (CPU tests, a shared GPU).
        memory_margin: share of the GPU kept free when no budget is given.
        compare_after_steps: optimizer steps after which measured and predicted are compared and kept.
        record: where run records go: True for `records.records_path()`, a path, or False (none kept).

    Raises:
        InputError: an unknown mode or a budget that is not a positive integer.
    """

    def __init__(self, *, mode: str | None, gpu: str | GPU | None, limit_bytes: int | None, memory_margin: float,
                 compare_after_steps: int, record: bool | str | Path) -> None:
        self.mode = check_mode(mode)
        if limit_bytes is not None and (isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int)
                                        or limit_bytes <= 0):
            raise InputError(f"limit_bytes must be a positive integer, got {limit_bytes!r}")
        if compare_after_steps <= 0:
            raise InputError(f"compare_after_steps must be greater than 0, got {compare_after_steps}")
        self.gpu, self.limit_bytes, self.margin = gpu, limit_bytes, memory_margin
        self.compare_after_steps = compare_after_steps
        self.record = record
        self.result: Preflight | None = None
        """The pre-flight, once made (None: not made, or it could not be)."""
        self.skipped: str | None = None
        """Why no prediction was made."""
        self.comparison: dict[str, Any] | None = None
        """Measured beside predicted, after `compare_after_steps` steps."""
        self.record_path: Path | None = None
        """Where the run record was appended."""
        self.running: Estimate | None = None
        """The prediction of the recipe the run trains with, where "fit" changed it."""

    def check(self, inputs: Callable[[], tuple[Workload, Recipe, int]]) -> Preflight | None:
        """Predict the run `inputs()` describes (workload, recipe, devices); log the table; refuse if
        the mode says so. `inputs` runs inside, so an input anatomist cannot read skips the pre-flight.

        Raises:
            PreflightRefused: "refuse" (or "fit" with nothing that fits) and the run will not fit.
            BelowWeights: "refuse" or "fit", and the budget is below the weights alone.
        """
        if self.mode is None:
            return None
        try:
            gpu, margin = target_gpu(self.gpu, self.limit_bytes, self.margin)
            workload, recipe, num_gpus = inputs()
            result = preflight(workload, recipe, gpu, num_gpus=num_gpus, margin=margin, mode=self.mode,
                               budget_bytes=self.limit_bytes)
        except BelowWeights as exc:
            if self.mode != "warn":
                raise
            self.skipped = str(exc)
            logger.warning("anatomist pre-flight: %s; the run goes on (preflight=\"warn\")", exc)
            return None
        except InputError as exc:  # a prediction that cannot be made: said, and the run goes on
            self.skipped = str(exc)
            logger.warning("anatomist pre-flight skipped, the run goes on: %s", exc)
            return None
        self.result = result
        if is_rank_zero():  # every process predicts (and refuses alike); one says it
            logger.warning("%s", result.table())
        if result.refused and (self.mode == "refuse" or (self.mode == "fit" and result.change is None)):
            raise PreflightRefused(result.refusal())
        return result

    def adopt_change(self) -> None:
        """The run goes on with the pre-flight's change ("fit"): what it is compared with and kept as is
        the change's prediction."""
        from anatomist.estimate.predict import estimate

        assert self.result is not None and self.result.change is not None
        given = self.result.estimate
        self.running = estimate(given.workload, self.result.change.recipe, given.gpu, num_gpus=self.result.num_gpus,
                                margin=given.margin)

    def compare(self, recorder: Recorder) -> dict[str, Any] | None:
        """After `compare_after_steps` steps: measured peaks and step time beside the prediction,
        appended as a run record; the flat dict a Trainer logs (None before that step, or without a prediction)."""
        if self.result is None or self.comparison is not None or len(recorder.step_times_s) < self.compare_after_steps:
            return None
        e = self.running or self.result.estimate
        stats, snap = allocator_stats(), device_snapshot()
        median_s = statistics.median(recorder.step_times_s)
        measured: dict[str, Any] = {
            "peak_allocated": stats.peak_allocated_bytes if stats else None,
            "peak_reserved": stats.peak_reserved_bytes if stats else None,
            "device_total": snap.used_bytes if snap.source == "nvml" else None,
            "process_peak_rss": snap.peak_bytes,
        }
        anatomy = e.memory.anatomy
        predicted: dict[str, Any] = {"peak_allocated": anatomy.peak_allocated, "peak_reserved": anatomy.peak_reserved,
                                     "device_total": anatomy.device_total,
                                     "median_step_s": e.time.step_s if e.time is not None else None}
        self.comparison = {"measured": measured, "predicted": predicted, "median_step_s": median_s,
                           "steps": len(recorder.step_times_s)}
        if self.record is not False and is_rank_zero():  # one record per run
            self._keep(measured, predicted, median_s, recorder.samples_per_step)
        logs = {f"anatomist/predicted_{k}": v for k, v in predicted.items() if v is not None}
        logs.update({f"anatomist/measured_{k}": v for k, v in measured.items() if v is not None})
        logs["anatomist/measured_median_step_s"] = median_s
        return logs

    def _keep(self, measured: dict[str, Any], predicted: dict[str, Any], median_s: float, samples: int) -> None:
        from anatomist.measure.monitor import device_info, versions
        from anatomist.measure.run_log import append_record

        assert self.result is not None
        e = self.running or self.result.estimate
        device = device_info()
        if device["kind"] == "cpu":
            device["note"] = "no GPU: a CPU run; no GPU figure was measured"
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        record = {
            "name": f"{e.workload.name} {now}", "kind": "run", "time": now, "model": e.workload.name,
            "workload": {"model": e.workload.name, "model_config": e.workload.config_json, "seq_len": e.workload.seq_len,
                         "task": e.workload.task},
            "recipe": e.recipe.to_dict(), "num_gpus": self.result.num_gpus, "device": device,
            "versions": versions(), "status": "ok", "reason": None, "preflight": self.mode,
            "measured": {"memory": measured, "time": {"median_step_s": median_s,
                                                      "samples_per_second": samples / median_s if median_s else None}},
            "predicted": {"memory": predicted, "gpu": e.gpu.name, "limit_bytes": e.memory.limit_bytes,
                          "budget_bytes": self.limit_bytes,
                          "fits": e.memory.fits, "verdict": e.memory.verdict},
            "error_pct": {k: (predicted[k] - v) / v * 100 for k, v in measured.items()
                          if v and predicted.get(k) is not None},
        }
        try:
            self.record_path = append_record(record, None if isinstance(self.record, bool) else self.record)
        except OSError as exc:  # a record is worth a warning, never a failed run
            logger.warning("anatomist: run record not kept: %s", exc)


__all__ = ["DEFAULT_MEMORY_MARGIN", "PreflightRefused", "Watch"]
