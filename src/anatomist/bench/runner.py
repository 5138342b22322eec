"""Run a suite: one fresh subprocess per row (or, on several processes, one launch per row), each
finished row appended durably at once.

A row that OOMs or crashes (even a worker killed by a signal) is recorded with its reason
and the suite goes on. With `resume`, rows already in the results file are not run again: a row
is the suite, the row's name and the number of processes it ran on.
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

from anatomist.bench.store import ResultsFile, row_key
from anatomist.bench.suites import Row, Suite
from anatomist.errors import InputError
from anatomist.measure.monitor import cuda_available, device_info, device_snapshot, versions
from anatomist.workload import Task
from anatomist.workload_loader import load_workload

DISTRIBUTED_STEPS = 3
"""Optimizer steps of a row on several processes (the first makes the optimizer state); FSDP rows run
one more under FSDPMemTracker (bench/fsdp_worker.py)."""


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


def base_row(run: SuiteRun, row: Row, num_processes: int = 1) -> dict[str, Any]:
    """The fields every row has, whatever happens to the run."""
    return {
        "suite": run.suite.name, "name": row.name, "num_processes": num_processes, "model": run.model_label,
        "recipe": row.recipe.to_dict(), "loop": row.loop, "device": _parent_device(), "versions": versions(),
        "status": "skipped", "reason": None, "measured": {}, "predicted": {}, "error_pct": {}, "notes": [],
    }


def check_rows(run: SuiteRun, rows: list[Row], num_processes: int) -> None:
    """Refuse, before any row runs, a row that cannot run on `num_processes` processes here (a row that
    says it needs CUDA, on a machine without it, is not refused: it is recorded as skipped).

    Raises:
        InputError: a row whose step the bench does not run (TRL's trainers, their activation offloading and packed
            rows: the rows run transformers' Trainer or an Accelerate loop on padded rows; Liger Kernel in the
            Accelerate loop, which does not apply it); an FSDP row on one process (it would shard nothing); on
            several, what `distributed.check_launchable` refuses (DeepSpeed ZeRO without CUDA).
    """
    from anatomist.bench.distributed import check_launchable

    for row in rows:
        recipe = row.recipe
        trl = [name for name, on in (("trainer " + recipe.trainer, recipe.trainer != "trainer"),
                                     ("activation_offloading", recipe.activation_offloading),
                                     ("padding_free", recipe.padding_free), ("packing", recipe.packing)) if on]
        if trl:
            raise InputError(f"row {row.name!r} sets {', '.join(trl)}, which TRL's trainers run; the bench runs "
                             "transformers' Trainer (or an Accelerate loop) on padded rows")
        if row.loop == "accelerate" and recipe.use_liger_kernel:
            raise InputError(f"row {row.name!r}: the Accelerate loop does not apply Liger Kernel (the Trainer's "
                             "use_liger_kernel does): use loop: trainer")
        if "cuda" in row.needs and run.on_cpu:
            continue
        if recipe.tp_size > 1:
            raise InputError(f"row {row.name!r} splits the model with tensor parallel (tp_size={recipe.tp_size}), "
                             "which the bench does not launch yet: `anatomist estimate` predicts it")
        if recipe.ep_size > 1 or recipe.sequence_parts > 1:
            split = (f"expert parallel (ep_size={recipe.ep_size})" if recipe.ep_size > 1
                     else f"context parallel (cp_size={recipe.cp_size})" if recipe.cp_size > 1
                     else f"sequence parallel (sp_size={recipe.sp_size})")
            raise InputError(f"row {row.name!r} runs {split}, which the bench does not launch yet: `anatomist "
                             "estimate` predicts it")
        if recipe.dp_replicate_size > 1:
            raise InputError(f"row {row.name!r} replicates FSDP's shards (HSDP, dp_replicate_size="
                             f"{recipe.dp_replicate_size}), which the bench does not launch yet: `anatomist estimate` "
                             "predicts it")
        if num_processes == 1 and row.recipe.fsdp != "none":
            raise InputError(f"row {row.name!r} shards the model with FSDP ({row.recipe.fsdp}), which on one process "
                             "shards nothing: run it with --num-processes 2 or more")
        if num_processes > 1:
            try:
                check_launchable(row.recipe, num_processes)
            except InputError as exc:
                raise InputError(f"row {row.name!r}: {exc}") from None


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


def run_row_distributed(run: SuiteRun, row: Row, num_processes: int, *, steps: int = DISTRIBUTED_STEPS,
                        timeout_s: float = 900) -> dict[str, Any]:
    """Run `row` on `num_processes` processes (bench/distributed.py: torchrun for FSDP, accelerate launch
    otherwise) for `steps` optimizer steps; never raises for a failed run.

    `measured.ranks` is what each process measured; `measured.memory` the largest of the ranks' figures,
    category by category, which `error_pct` compares with the per-process prediction; each rank has
    its own `error_pct` too.
    """
    from anatomist.bench.distributed import launch, launcher_for
    from anatomist.bench.worker import error_pct, predict

    result = base_row(run, row, num_processes)
    result["workload"] = {"model": run.model, "model_config": run.model_config, "seq_len": run.seq_len,
                          "task": run.task}
    with tempfile.TemporaryDirectory(prefix="anatomist-row-") as tmp:
        model = run.model
        if run.model_config:
            (Path(tmp) / "config.json").write_text(json.dumps(run.model_config))
            model = tmp
        workload = load_workload(model, seq_len=run.seq_len, task=run.task)
        try:
            ranks = launch(model, row.recipe, num_processes, task=run.task, seq_len=run.seq_len, steps=steps,
                           timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            result.update(status="error", reason=f"timed out after {timeout_s} s")
            return result
        except RuntimeError as exc:
            oom = "out of memory" in str(exc).lower()
            result.update(status="oom" if oom else "error", reason=str(exc).splitlines()[0])
            return result
        try:
            result["predicted"], result["notes"] = predict(workload, row.recipe.resolved(workload),
                                                           num_gpus=num_processes)
        except InputError as exc:  # a setting the estimator does not model: the measurement stands alone
            result["predicted"], result["notes"] = {"memory": {}, "time": {}}, [f"no prediction: {exc}"]
    samples = steps * row.recipe.per_device_train_batch_size * row.recipe.gradient_accumulation_steps * num_processes
    runtime_s = max(r["train_runtime_s"] for r in ranks)
    memory: dict[str, int] = {}
    for rank in ranks:
        rank["error_pct"] = error_pct(rank, result["predicted"])
        for category, value in rank["memory"].items():
            if value is not None:
                memory[category] = max(memory.get(category, 0), value)
    result["measured"] = {"launcher": launcher_for(row.recipe), "steps": steps, "train_runtime_s": runtime_s,
                          "samples_per_second": samples / runtime_s, "memory": memory, "ranks": ranks}
    result.update(status="ok", error_pct=error_pct(result["measured"], result["predicted"]))
    return result


def run_suite(
    run: SuiteRun,
    rows: list[Row],
    store: ResultsFile,
    *,
    resume: bool = False,
    num_processes: int = 1,
    on_row: Callable[[dict[str, Any], bool], None] | None = None,
) -> list[dict[str, Any]]:
    """Run `rows` one by one, each on `num_processes` processes, and append each result to `store` the
    moment it exists.

    `on_row(row, reused)` is called after each row (reused: taken from the file by --resume).
    """
    done = {row_key(r): r for r in store.rows} if resume else {}
    out = []
    for row in rows:
        key = (run.suite.name, row.name, num_processes)
        if key in done:
            out.append(done[key])
            if on_row:
                on_row(done[key], True)
            continue
        reason = row.skip_reason(has_cuda=not run.on_cpu)
        if reason is not None:
            result = base_row(run, row, num_processes)
            result["reason"] = reason
        elif num_processes > 1:
            result = run_row_distributed(run, row, num_processes)
        else:
            result = run_row_isolated(run, row)
        store.append(result)
        out.append(result)
        if on_row:
            on_row(result, False)
    return out
