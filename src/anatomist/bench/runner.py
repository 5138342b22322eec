"""Run a suite: one fresh subprocess per row, each finished row appended durably at once.

A row that OOMs or crashes (even a worker killed by a signal) is recorded with its reason
and the suite goes on. With `resume`, rows already in the results file are not run again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anatomist.bench.store import ResultsFile
from anatomist.bench.suites import Row, Suite
from anatomist.measure.monitor import cuda_available, device_info, device_snapshot, versions
from anatomist.workload import Task, load_workload


@dataclass(kw_only=True, slots=True)
class SuiteRun:
    """What the suite will run here: the model, the data shape, CPU or GPU."""

    suite: Suite
    model: str
    model_label: str
    model_config: dict[str, Any] | None
    task: Task
    seq_len: int
    num_samples: int
    on_cpu: bool


def prepare_suite(suite: Suite, model: str | None = None) -> SuiteRun:
    """The suite's configuration on this machine: the full one on a GPU, the small one on CPU.

    Raises:
        InputError: the model cannot be resolved (checked before any row runs).
    """
    on_cpu = not cuda_available()
    cpu = suite.cpu if on_cpu and model is None else {}
    config = cpu.get("model_config")
    name = model or cpu.get("model") or suite.model
    seq_len = int(cpu.get("seq_len", suite.seq_len))
    if config is None:
        load_workload(name, seq_len=seq_len, task=suite.task)  # unknown model -> InputError now
        label = name
    else:
        label = (f"{suite.model} stand-in for CPU: {config['model_type']} hidden {config.get('hidden_size')}, "
                 f"{config.get('num_hidden_layers')} layers")
    return SuiteRun(suite=suite, model=name, model_label=label, model_config=config, task=suite.task, seq_len=seq_len,
                num_samples=int(cpu.get("num_samples", suite.num_samples)), on_cpu=on_cpu)


def _parent_device() -> dict[str, Any]:
    """The device without creating a CUDA context in the parent (NVML only): rows run in workers."""
    if not cuda_available():
        return device_info()
    snap = device_snapshot()
    return {"name": snap.name, "kind": "cuda", "memory_bytes": snap.total_bytes}


def base_row(run: SuiteRun, row: Row) -> dict[str, Any]:
    """The fields every row has, whatever happens to the run."""
    return {
        "suite": run.suite.name, "name": row.name, "model": run.model_label, "recipe": row.recipe.to_dict(),
        "loop": row.loop, "device": _parent_device(), "versions": versions(), "status": "skipped", "reason": None,
        "measured": {}, "predicted": {}, "error_pct": {}, "notes": [],
    }


def run_row_isolated(run: SuiteRun, row: Row, *, timeout_s: float | None = None) -> dict[str, Any]:
    """Run `row` in a fresh `python -m anatomist.bench.worker` process; never raises for a failed run."""
    result = base_row(run, row)
    spec = {
        "suite": run.suite.name, "name": row.name, "model": run.model, "model_label": run.model_label,
        "model_config": run.model_config, "task": run.task, "seq_len": run.seq_len, "num_samples": run.num_samples,
        "num_train_epochs": run.suite.num_train_epochs, "recipe": row.recipe.to_dict(), "loop": row.loop,
    }
    with tempfile.TemporaryDirectory(prefix="anatomist-row-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "row.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "anatomist.bench.worker", str(spec_path), str(out_path)]
        try:
            proc = subprocess.run(cmd, env=os.environ.copy(), capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            result.update(status="error", reason=f"timed out after {timeout_s} s")
            return result
        if out_path.is_file():
            result.update(json.loads(out_path.read_text()))
        else:
            tail = (proc.stderr or "").strip().splitlines()[-1:] or [""]
            oom = "out of memory" in (proc.stderr or "").lower()
            result.update(status="oom" if oom else "error",
                          reason=f"worker exited with code {proc.returncode} without a result: {tail[0]}")
    return result


def run_suite(
    run: SuiteRun,
    rows: list[Row],
    store: ResultsFile,
    *,
    resume: bool = False,
    on_row: Callable[[dict[str, Any], bool], None] | None = None,
) -> list[dict[str, Any]]:
    """Run `rows` one by one and append each result to `store` the moment it exists.

    `on_row(row, reused)` is called after each row (reused: taken from the file by --resume).
    """
    done = {r["name"]: r for r in store.rows if r.get("suite") == run.suite.name} if resume else {}
    out = []
    for row in rows:
        if row.name in done:
            out.append(done[row.name])
            if on_row:
                on_row(done[row.name], True)
            continue
        reason = row.skip_reason(has_cuda=not run.on_cpu)
        if reason is not None:
            result = base_row(run, row)
            result["reason"] = reason
        else:
            result = run_row_isolated(run, row)
        store.append(result)
        out.append(result)
        if on_row:
            on_row(result, False)
    return out
