"""Suites: a model, a dataset shape and named rows of recipes, kept as data (YAML).

The shipped suites live in anatomist/data/suites/*.yaml (`seeds` is the seeds' experiment);
a user passes their own file with the same keys. Each row names a Recipe, the loop that
runs it ("trainer" or "accelerate") and what it needs ("cuda" or a Python package).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from anatomist.errors import InputError
from anatomist.model_facts import TASKS
from anatomist.recipe import Recipe
from anatomist.recipe.packages import missing_packages
from anatomist.workload import Task

Loop = Literal["trainer", "accelerate"]
_SUITE_KEYS = {"name", "description", "model", "task", "seq_len", "num_samples", "num_train_epochs", "num_processes",
               "cpu", "rows"}
_ROW_KEYS = {"name", "recipe", "loop", "needs", "cpu_reason"}
_CPU_KEYS = {"model_config", "model", "seq_len", "num_samples"}


@dataclass(kw_only=True, slots=True)
class Row:
    """One run of the suite."""

    name: str
    recipe: Recipe
    loop: Loop = "trainer"
    needs: tuple[str, ...] = ()
    """"cuda" and/or importable package names; a row lacking one is skipped with the reason."""
    cpu_reason: str | None = None
    """Why the row cannot run on CPU, when "cuda" alone does not say it."""

    def skip_reason(self, *, has_cuda: bool) -> str | None:
        """Why this row cannot run here, or None."""
        if "cuda" in self.needs and not has_cuda:
            return self.cpu_reason or "needs a CUDA GPU (this machine has none)"
        packages = [n for n in self.needs if n != "cuda"] + missing_packages(self.recipe)
        missing = [n for n in dict.fromkeys(packages) if importlib.util.find_spec(n) is None]
        if missing:
            return f"needs the package(s) {', '.join(missing)}: pip install {' '.join(missing)}"
        return None


@dataclass(kw_only=True, slots=True)
class Suite:
    """A model and data shape, the small CPU variant of them, and the rows."""

    name: str
    model: str
    seq_len: int
    num_samples: int
    task: Task = "sequence-classification"
    """Which head is trained (the seeds' experiment classifies; a language model suite is causal-lm)."""
    num_train_epochs: float = 1
    num_processes: int = 1
    """Processes each row runs on unless `--num-processes` says otherwise (>1: bench/distributed.py)."""
    description: str = ""
    cpu: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)

    def select(self, names: list[str] | None) -> list[Row]:
        """The rows named (in the suite's order), all of them for None."""
        if not names:
            return list(self.rows)
        known = [r.name for r in self.rows]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise InputError(f"unknown row(s) {', '.join(unknown)} in suite {self.name!r}; known: {', '.join(known)}")
        return [r for r in self.rows if r.name in names]


def shipped_suites() -> list[str]:
    folder = resources.files("anatomist.data").joinpath("suites")
    return sorted(e.name.removesuffix(".yaml") for e in folder.iterdir() if e.name.endswith(".yaml"))


def load_suite(name_or_path: str) -> Suite:
    """A shipped suite by name, or a YAML file.

    Raises:
        InputError: unknown name (with the known ones), unreadable or malformed file.
    """
    path = Path(name_or_path).expanduser()
    if path.is_file():
        text, where = path.read_text(), str(path)
    elif name_or_path in shipped_suites():
        text = resources.files("anatomist.data").joinpath("suites", f"{name_or_path}.yaml").read_text()
        where = f"suite {name_or_path}"
    else:
        raise InputError(
            f"unknown suite {name_or_path!r}: not a file and not a shipped suite (known: {', '.join(shipped_suites())})"
        )
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InputError(f"{where}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:  # nothing but blanks and comments
        raise InputError(f"suite file {where!r} is empty")
    return _suite_from_dict(data, where)


def _suite_from_dict(data: Any, where: str) -> Suite:
    if not isinstance(data, dict):
        raise InputError(f"{where}: a suite must be a mapping with keys {', '.join(sorted(_SUITE_KEYS))}")
    unknown = sorted(set(data) - _SUITE_KEYS)
    if unknown:
        raise InputError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_SUITE_KEYS))}")
    for key in ("model", "rows"):
        if key not in data:
            raise InputError(f"{where}: key {key!r} is missing")
    cpu = data.get("cpu") or {}
    if not isinstance(cpu, dict) or set(cpu) - _CPU_KEYS:
        raise InputError(f"{where}: cpu must be a mapping with keys among {', '.join(sorted(_CPU_KEYS))}")
    raw_rows = data["rows"]
    if not isinstance(raw_rows, list) or not raw_rows:
        raise InputError(f"{where}: rows must be a non-empty list")
    rows = [_row_from_dict(r, f"{where}, row {i + 1}") for i, r in enumerate(raw_rows)]
    names = [r.name for r in rows]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InputError(f"{where}: duplicate row name(s) {', '.join(duplicates)}")
    for key, default in (("seq_len", 512), ("num_samples", 512), ("num_processes", 1)):
        value = data.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InputError(f"{where}: {key} must be a positive integer, got {value!r}")
    task: Task = data.get("task", "sequence-classification")
    if task not in TASKS:
        raise InputError(f"{where}: task must be one of {', '.join(TASKS)}, got {task!r}")
    return Suite(
        name=str(data.get("name", where)), model=str(data["model"]), task=task, seq_len=data.get("seq_len", 512),
        num_samples=data.get("num_samples", 512), num_train_epochs=float(data.get("num_train_epochs", 1)),
        num_processes=data.get("num_processes", 1),
        description=str(data.get("description", "")), cpu=cpu, rows=rows,
    )


def _row_from_dict(data: Any, where: str) -> Row:
    if not isinstance(data, dict) or "name" not in data:
        raise InputError(f"{where}: a row must be a mapping with at least a name")
    unknown = sorted(set(data) - _ROW_KEYS)
    if unknown:
        raise InputError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_ROW_KEYS))}")
    loop = data.get("loop", "trainer")
    if loop not in ("trainer", "accelerate"):
        raise InputError(f"{where}: loop must be trainer or accelerate, got {loop!r}")
    recipe = data.get("recipe") or {}
    if not isinstance(recipe, dict):
        raise InputError(f"{where}: recipe must be a mapping of TrainingArguments fields")
    needs = data.get("needs") or []
    if not isinstance(needs, list) or not all(isinstance(n, str) for n in needs):
        raise InputError(f"{where}: needs must be a list of names")
    return Row(name=str(data["name"]), recipe=Recipe.from_dict(recipe, source=where), loop=loop,
               needs=tuple(needs), cpu_reason=data.get("cpu_reason"))
