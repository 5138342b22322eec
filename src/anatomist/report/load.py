"""Read what the other commands write and turn it into one `ReportData` the charts can draw.

Four inputs are recognised by their keys, so the user never says which one they pass:

- an estimate (`anatomist estimate --json`): an object with "memory" and "gpu";
- a plan (`anatomist plan --json`): an object with "candidates", "pareto" and "best";
- a profile (`anatomist profile --json`): an object with "classes" and "phases";
- bench results: the JSONL file `anatomist bench` writes (one row per line, optionally after a
  header line `{"anatomist_results": <schema version>, ...}`), or `{"rows": [...]}` from
  `anatomist bench --json`.

Why tolerant: a results file is precious (hours of GPU time), so a missing optional key or an
older schema must not cost the user their pictures. Every gap is said plainly in
`ReportData.notices`, which the HTML shows at the top. Input that is not ours at all (empty,
corrupt, foreign) raises InputError: one line, exit 2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from anatomist.anatomy import MemoryCategory
from anatomist.errors import InputError
from anatomist.recipe_labels import labels, recipe_from_dict

RESULTS_SCHEMA_VERSION = 1
"""The bench results schema this report reads (the header line's "anatomist_results" value)."""

HEADER_KEY = "anatomist_results"
MEMORY_KEYS: tuple[str, ...] = tuple(c.value for c in MemoryCategory)
Kind = Literal["estimate", "plan", "profile", "bench"]


def peak_bytes(memory: dict[str, Any] | None) -> int | None:
    """A recipe's memory on the charts: its device total (what nvidia-smi shows); a CPU run
    has none, so its peak allocated bytes."""
    if not memory:
        return None
    total = memory.get("device_total")
    return total if total is not None else memory.get("peak_allocated")


def comparable_peaks(predicted: dict[str, Any] | None, measured: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """Predicted and measured peaks on the same footing: device totals where the run has one,
    else (a CPU run) peak allocated bytes on both sides."""
    key = "device_total" if (measured or {}).get("device_total") is not None else "peak_allocated"
    return (predicted or {}).get(key), (measured or {}).get(key)


@dataclass(kw_only=True, slots=True)
class RecipeResult:
    """One recipe's numbers, whichever command produced them."""

    label: str
    """Its own name: a bench row's; for an estimate or a plan entry, its recipe named by what it switches on
    ("bs4, fp16, ckpt"). Where several are drawn together, `about.distinguishing` names each by what differs."""
    named: bool = False
    """The label is the name the suite gave the row (kept as it is); else it comes from the recipe."""
    best: bool = False
    """The plan's top pick."""
    model: str
    recipe: dict[str, Any]
    status: str
    """"predicted" for estimate/plan entries; bench's "ok" | "oom" | "error" | "skipped"."""
    reason: str | None = None
    parameters: int | None = None
    """The model's parameter count, where the input says it (estimate does; bench rows do not)."""
    seq_len: int | None = None
    gpu_name: str | None = None
    gpu_memory_bytes: int | None = None
    limit_bytes: int | None = None
    """The usable memory that decides "fits": the capacity less the margin (estimate and plan say it)."""
    num_gpus: int = 1
    predicted_memory: dict[str, Any] | None = None
    measured_memory: dict[str, Any] | None = None
    predicted_samples_per_second: float | None = None
    measured_samples_per_second: float | None = None
    pareto: bool = False
    """True when the plan put this entry on its Pareto front."""

    @property
    def memory(self) -> dict[str, Any] | None:
        """The anatomy to draw: measured when there is one, else predicted."""
        return self.measured_memory or self.predicted_memory

    @property
    def memory_source(self) -> str:
        return "measured" if self.measured_memory else "predicted"

    @property
    def samples_per_second(self) -> float | None:
        if self.measured_samples_per_second is not None:
            return self.measured_samples_per_second
        return self.predicted_samples_per_second

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "predicted")


@dataclass(kw_only=True, slots=True)
class ReportData:
    """Everything the report draws, from one or more input files."""

    sources: list[str] = field(default_factory=list)
    kinds: list[Kind] = field(default_factory=list)
    results: list[RecipeResult] = field(default_factory=list)
    classes: dict[str, dict[str, float]] | None = None
    """Operation class -> {"flops_pct", "time_pct"} (from a profile)."""
    phases: dict[str, float] | None = None
    top_ops: list[dict[str, Any]] = field(default_factory=list)
    profile_device: str | None = None
    notices: list[str] = field(default_factory=list)
    """Plain sentences about gaps in the input, shown at the top of the report."""

    @property
    def ok_results(self) -> list[RecipeResult]:
        return [r for r in self.results if r.ok and r.memory is not None]

    @property
    def failed_results(self) -> list[RecipeResult]:
        return [r for r in self.results if not r.ok]


def load(inputs: Any | list[Any]) -> ReportData:
    """Load one input or several (paths or already-parsed JSON objects) into one ReportData.

    Raises:
        InputError: a file is missing, empty, not JSON, or not something anatomist wrote.
    """
    items = inputs if isinstance(inputs, list) else [inputs]
    if not items:
        raise InputError("no results given: pass an estimate, plan, profile or bench results file")
    data = ReportData()
    for item in items:
        if isinstance(item, dict):
            _add(data, item, source="(in memory)")
        else:
            path = Path(item)
            _add(data, _read(path), source=str(path))
    return data


def _read(path: Path) -> dict[str, Any]:
    """Parse a JSON object or a JSONL file into a dict; bench JSONL becomes {"rows", "header"}."""
    if not path.exists():
        raise InputError(f"results file {path} does not exist")
    if path.is_dir():
        raise InputError(f"{path} is a directory; pass the results file inside it")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path} is not a text file: expected anatomist JSON or JSONL") from None
    if not text.strip():
        raise InputError(f"results file {path} is empty")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return _read_jsonl(path, text)
    if isinstance(obj, list):  # a bare list of rows
        return {"rows": obj}
    if not isinstance(obj, dict):
        raise InputError(f"{path} holds a JSON {type(obj).__name__}, not an anatomist result object")
    if _is_bench_row(obj):  # a JSONL file with exactly one row
        return {"rows": [obj]}
    return obj


def _read_jsonl(path: Path, text: str) -> dict[str, Any]:
    header: dict[str, Any] | None = None
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path} line {number} is not valid JSON ({exc.msg}): not an anatomist results file") from None
        if not isinstance(obj, dict):
            raise InputError(f"{path} line {number} is not a JSON object: not an anatomist results file")
        if HEADER_KEY in obj:
            header = obj
        else:
            rows.append(obj)
    return {"rows": rows, "header": header or {}}


def _is_bench_row(obj: dict[str, Any]) -> bool:
    return "status" in obj and ("measured" in obj or "predicted" in obj or "recipe" in obj)


def detect_kind(obj: dict[str, Any]) -> Kind:
    """Which command wrote `obj`, by its keys."""
    if "rows" in obj or HEADER_KEY in obj:
        return "bench"
    if "memory" in obj and "gpu" in obj:
        return "estimate"
    if {"candidates", "pareto", "best"} <= obj.keys():
        return "plan"
    if "classes" in obj and "phases" in obj:
        return "profile"
    keys = ", ".join(sorted(obj)[:6]) or "none"
    raise InputError(
        f"not an anatomist estimate, plan, profile or bench results file (top-level keys: {keys})"
    )


def _add(data: ReportData, obj: dict[str, Any], *, source: str) -> None:
    try:
        kind = detect_kind(obj)
    except InputError as exc:
        raise InputError(f"{source}: {exc}") from None
    data.sources.append(source)
    data.kinds.append(kind)
    if kind == "estimate":
        data.results.append(_from_estimate(obj, data.notices))
    elif kind == "plan":
        _add_plan(data, obj)
    elif kind == "profile":
        _add_profile(data, obj)
    else:
        _add_bench(data, obj, source)


def _from_estimate(obj: dict[str, Any], notices: list[str]) -> RecipeResult:
    gpu = obj.get("gpu") or {}
    time = obj.get("time") or {}
    recipe = obj.get("recipe") or {}
    return RecipeResult(
        label=recipe_label(recipe),
        model=str(obj.get("model", "?")),
        recipe=recipe,
        status="predicted",
        parameters=_int(obj.get("parameters")),
        seq_len=_int(obj.get("seq_len")),
        gpu_name=gpu.get("name"),
        gpu_memory_bytes=gpu.get("memory_bytes"),
        limit_bytes=_int(obj.get("limit_bytes")),
        num_gpus=_int(obj.get("num_gpus")) or 1,
        predicted_memory=_memory(obj.get("memory"), "estimate", notices),
        predicted_samples_per_second=time.get("samples_per_second"),
    )


def _add_plan(data: ReportData, obj: dict[str, Any]) -> None:
    entries = obj.get("pareto") or []
    best = obj.get("best")
    if best and best not in entries:
        entries = [*entries, best]
    if not entries:
        data.notices.append(
            f"The plan found no feasible recipe ({obj.get('feasible', 0)} of {obj.get('candidates', '?')} candidates fit)."
        )
    gpu = obj.get("gpu") or {}
    for entry in entries:
        recipe = entry.get("recipe") or {}
        time = entry.get("time") or {}
        data.results.append(RecipeResult(
            label=recipe_label(recipe), best=entry == best, model=str(obj.get("model", entry.get("model", "?"))), recipe=recipe, status="predicted",
            reason="; ".join(entry.get("reasons") or []) or None,
            parameters=_int(obj.get("parameters")), seq_len=_int(obj.get("seq_len")),
            gpu_name=gpu.get("name"), gpu_memory_bytes=gpu.get("memory_bytes"),
            limit_bytes=_int(obj.get("limit_bytes")), num_gpus=_int(obj.get("num_gpus")) or 1,
            predicted_memory=_memory(entry.get("memory"), "plan entry", data.notices),
            predicted_samples_per_second=time.get("samples_per_second"),
            pareto=True,
        ))
    if gpu.get("memory_bytes") is None and entries:
        data.notices.append("The plan does not say which GPU it targets: no capacity line on the memory chart.")


def _add_profile(data: ReportData, obj: dict[str, Any]) -> None:
    classes = obj.get("classes") or {}
    data.classes = {
        name: {"flops_pct": float(v.get("flops_pct") or 0.0), "time_pct": float(v.get("time_pct") or 0.0)}
        for name, v in classes.items()
        if isinstance(v, dict)
    }
    data.phases = {k: float(v) for k, v in (obj.get("phases") or {}).items() if isinstance(v, int | float)}
    data.top_ops = [op for op in obj.get("top_ops") or [] if isinstance(op, dict)]
    data.profile_device = obj.get("device")
    if not data.classes:
        data.notices.append("The profile has no operation classes to chart.")


def _add_bench(data: ReportData, obj: dict[str, Any], source: str) -> None:
    header = obj.get("header") or {}
    version = header.get(HEADER_KEY, RESULTS_SCHEMA_VERSION if not header else None)
    if isinstance(version, int) and version < RESULTS_SCHEMA_VERSION:
        data.notices.append(
            f"{source} was written by an older anatomist (results schema {version}; this version reads "
            f"{RESULTS_SCHEMA_VERSION}). It is shown as far as its keys allow; run the suite again with this version to refresh it."
        )
    elif isinstance(version, int) and version > RESULTS_SCHEMA_VERSION:
        data.notices.append(
            f"{source} was written by a newer anatomist (results schema {version}; this version reads "
            f"{RESULTS_SCHEMA_VERSION}). Keys it does not know are ignored."
        )
    rows = obj.get("rows")
    if not isinstance(rows, list) or not rows:
        data.notices.append(f"{source} holds no result rows: the benchmark has not finished any recipe yet.")
        return
    no_status = 0
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise InputError(f"{source}: row {i + 1} is not a JSON object")
        if "status" not in row:
            no_status += 1
        data.results.append(_from_bench_row(row, i, data.notices))
    if no_status:
        data.notices.append(
            f"{no_status} row(s) in {source} have no \"status\" (an older or foreign format); they are read as failed."
        )
    failed = [r for r in data.results if not r.ok]
    if len(failed) == len(data.results):
        counts: dict[str, int] = {}
        for r in failed:
            counts[r.status] = counts.get(r.status, 0) + 1
        what = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        data.notices.append(f"Every run in {source} failed ({what}): there are no measurements to chart. "
                            "The table of failed runs below says why.")


def _from_bench_row(row: dict[str, Any], index: int, notices: list[str]) -> RecipeResult:
    recipe = row.get("recipe") or {}
    measured = row.get("measured") or {}
    predicted = row.get("predicted") or {}
    device = row.get("device") or {}
    status = str(row.get("status", "unknown"))
    ok = status == "ok"
    label = str(row.get("name") or recipe_label(recipe) or f"row {index + 1}")
    processes = _int(row.get("num_processes")) or 1
    return RecipeResult(
        label=label if processes == 1 else f"{label} x{processes}",  # measured and predicted per process
        named=bool(row.get("name")),
        num_gpus=processes,
        model=str(row.get("model", "?")),
        recipe=recipe,
        status=status,
        reason=row.get("reason"),
        parameters=_int(row.get("parameters")),
        seq_len=_int((row.get("workload") or {}).get("seq_len", row.get("seq_len"))),
        gpu_name=device.get("name"),
        gpu_memory_bytes=device.get("memory_bytes") or device.get("total_memory_bytes"),
        measured_memory=_memory(measured.get("memory"), f"row {row.get('name', index + 1)} (measured)", notices) if ok else None,
        predicted_memory=_memory(predicted.get("memory"), f"row {row.get('name', index + 1)} (predicted)", notices, quiet=True),
        measured_samples_per_second=measured.get("samples_per_second") if ok else None,
        predicted_samples_per_second=(predicted.get("time") or {}).get("samples_per_second"),
    )


def _int(value: Any) -> int | None:
    """An integer field of the input, or None where it is missing or not a number."""
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _memory(mem: Any, where: str, notices: list[str], *, quiet: bool = False) -> dict[str, Any] | None:
    """The memory object with every category present (missing ones become 0, said once)."""
    if not isinstance(mem, dict) or not mem:
        if not quiet:
            notices.append(f"{where} has no memory figures.")
        return None
    missing = [k for k in MEMORY_KEYS if k not in mem]
    if missing:
        notices.append(f"{where} lacks {', '.join(missing)}: drawn as 0.")
    out = dict(mem)
    for k in MEMORY_KEYS:
        out[k] = int(mem.get(k) or 0)
    if "device_total" not in mem:
        out["device_total"] = sum(out[k] for k in MEMORY_KEYS)
    return out


def recipe_label(recipe: dict[str, Any]) -> str:
    """A recipe object of a result file named by its batch and what it switches on ("bs4, fp16, ckpt"); the
    keys of an older or foreign file, which this version cannot read as a Recipe, as "key=value"."""
    parsed = recipe_from_dict(recipe) if recipe else None
    if parsed is not None:
        return labels([parsed])[0]
    return " ".join(f"{k}={v}" for k, v in recipe.items() if k in ("per_device_train_batch_size", "optim"))
