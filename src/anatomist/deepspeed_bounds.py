"""DeepSpeed's own bounds on a ds_config's numbers, as the DeepSpeed that will run it has them, kept on disk per version.

DeepSpeed validates its sections with pydantic models (deepspeed/runtime/zero/config.py DeepSpeedZeroConfig, the
offload sections in zero/offload_config.py): each number is a typed Field with its bounds (`ge=0`, `gt=0`, `le=1`),
and they change between releases: zero_optimization.reduce_bucket_size is `ge=0` in 0.19.5 and `gt=0` in 0.19.8.
anatomist refuses exactly what that DeepSpeed refuses, so the bounds are read from the installed deepspeed's models
(importing them imports deepspeed and torch: once per deepspeed version, then kept in
`<user cache>/deepspeed-bounds/deepspeed-V.json`), and where deepspeed is not installed from
data/deepspeed_keys.json (scripts/deepspeed_keys.py wrote it from the release it names).

A value is checked as pydantic checks it, in its lax mode (5e8 and "500" are whole numbers, 2.5 and "5e8" are not),
with pydantic's own validator where it is installed (DeepSpeed requires it); `DeepSpeedConfigModel` drops a value
"auto" before validating (its default then applies), which is therefore no error here either.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import operator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from anatomist.user_cache import cache_root, write_atomically

MODELS = {
    "zero_optimization": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "zero_optimization.offload_param": ("deepspeed.runtime.zero.offload_config", "DeepSpeedZeroOffloadParamConfig"),
    "zero_optimization.offload_optimizer": ("deepspeed.runtime.zero.offload_config",
                                            "DeepSpeedZeroOffloadOptimizerConfig"),
    "bf16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "fp16": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
}
"""The ds_config sections DeepSpeed validates with a pydantic model: (module, class)."""
LIMITS = ("gt", "ge", "lt", "le")
SYMBOLS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
COMPARE = {"gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le}


@dataclass(frozen=True, slots=True)
class Bound:
    """One bounded number of a DeepSpeed section: its type and its limits (pydantic's annotated_types)."""

    type: str
    """"int" (a whole number) or "float"."""
    limits: tuple[tuple[str, float], ...]
    """(gt|ge|lt|le, value), as the Field declares them."""

    def describe(self) -> str:
        """'a whole number > 0', 'a number >= 0 and <= 1'."""
        kind = "a whole number" if self.type == "int" else "a number"
        return kind + " " + " and ".join(f"{SYMBOLS[name]} {_plain(value)}" for name, value in self.limits)

    def check(self, value: Any) -> int | float | None:
        """`value` as DeepSpeed takes it (lax pydantic: 5e8 -> 500000000), or None where DeepSpeed refuses it."""
        number = _coerce(value, self.type)
        if number is None or not all(COMPARE[name](number, limit) for name, limit in self.limits):
            return None
        return number


def _plain(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _coerce(value: Any, kind: str) -> int | float | None:
    """pydantic's lax int / float, through pydantic itself where it is installed."""
    try:
        from pydantic import TypeAdapter, ValidationError
    except ImportError:  # no DeepSpeed here either: JSON and YAML numbers only
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if kind == "int":
            return int(value) if float(value).is_integer() else None
        return float(value)
    try:
        return TypeAdapter(int if kind == "int" else float).validate_python(value)  # type: ignore[no-any-return]
    except ValidationError:
        return None


@dataclass(frozen=True, slots=True)
class Bounds:
    """DeepSpeed's bounds by section and key (each field under its name and its alias, as DeepSpeed reads both)."""

    version: str
    """The deepspeed release they are read from."""
    sections: dict[str, dict[str, Bound]]

    def get(self, section: str, key: str) -> Bound | None:
        return self.sections.get(section, {}).get(key)

    def refusal(self, section: str, key: str, value: Any) -> str | None:
        """Why DeepSpeed refuses `value` for `section`.`key` (None: it takes it, or has no bound on it); "auto" is
        always taken (DeepSpeedConfigModel drops it)."""
        bound = self.get(section, key)
        if bound is None or value == "auto" or bound.check(value) is not None:
            return None
        return f"must be {bound.describe()} (deepspeed {self.version} refuses {value!r})"


def read_models(models: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """The bounded numbers of pydantic `models` (section -> model), as data/deepspeed_keys.json keeps them."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for section, model in models.items():
        fields = {}
        for name, info in model.model_fields.items():
            limits = [(limit, getattr(item, limit)) for item in info.metadata for limit in LIMITS
                      if getattr(item, limit, None) is not None]
            if not limits:
                continue
            kind = "int" if info.annotation is int else "float"
            entry = {"type": kind, "limits": limits}
            fields[name] = entry
            if info.alias:
                fields[info.alias] = entry
        table[section] = dict(sorted(fields.items()))
    return table


def _from_table(version: str, table: dict[str, Any]) -> Bounds:
    return Bounds(version=version, sections={
        section: {key: Bound(type=e["type"], limits=tuple((n, v) for n, v in e["limits"])) for key, e in keys.items()}
        for section, keys in table.items()})


def shipped() -> tuple[str, dict[str, Any]]:
    """The release data/deepspeed_keys.json was written from, and its bounds."""
    data = json.loads(resources.files("anatomist.data").joinpath("deepspeed_keys.json").read_text())
    return data["_source"].rsplit(" ", 1)[-1], data["bounds"]


def installed_version() -> str | None:
    """The installed deepspeed's version, from its metadata (no import); None where it is not installed."""
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


@cache
def deepspeed_bounds() -> Bounds:
    """The bounds of the installed deepspeed (from the file kept for its version, else its models, then kept), or the
    shipped ones where deepspeed is not installed or is the release they were read from."""
    version, table = shipped()
    here = installed_version()
    if here is None or here == version:
        return _from_table(version, table)
    path = cache_root() / "deepspeed-bounds" / f"deepspeed-{here}.json"
    try:
        return _from_table(here, json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing or damaged: read the models
    table = _read_installed()
    try:
        write_atomically(path, json.dumps(table, indent=0, sort_keys=True).encode())
    except OSError:
        pass  # read again next time
    return _from_table(here, table)


def _read_installed() -> dict[str, Any]:
    """The installed deepspeed's models, read quietly (importing it logs its accelerator to stdout)."""
    import importlib

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        models = {section: getattr(importlib.import_module(module), name) for section, (module, name) in MODELS.items()}
    return read_models(models)
