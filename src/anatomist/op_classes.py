"""Map an ATen operator name to its operation class (data/op_classes.toml).

The same table serves the time prediction (ops recorded on fake tensors) and the profiler
(ops recorded on a real run), so both report the same four classes.

Example:
    >>> classify("aten::addmm")
    <OpClass.CONTRACTION: 'contraction'>
    >>> classify("aten::native_layer_norm_backward")
    <OpClass.NORMALIZATION: 'normalization'>
"""

from __future__ import annotations

import fnmatch
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources

from anatomist.anatomy import OpClass

_BACKWARD_SUFFIXES = ("_backward_data", "_backward")


@dataclass(kw_only=True, slots=True, frozen=True)
class OpClassTable:
    """The table as loaded: exact names and wildcard patterns per class, and the view ops."""

    exact: dict[str, OpClass]
    patterns: tuple[tuple[str, OpClass], ...]
    views: frozenset[str]


@cache
def table() -> OpClassTable:
    raw = tomllib.loads(resources.files("anatomist.data").joinpath("op_classes.toml").read_text())
    exact: dict[str, OpClass] = {}
    patterns: list[tuple[str, OpClass]] = []
    for cls in OpClass:
        for name in raw[cls.value]:
            if any(ch in name for ch in "*?["):
                patterns.append((name, cls))
            else:
                exact[name] = cls
    return OpClassTable(exact=exact, patterns=tuple(patterns), views=frozenset(raw["view"]))


def base_name(op_name: str) -> str:
    """`aten::native_layer_norm.default` -> `native_layer_norm`; `aten.add_.Tensor` -> `add_`."""
    name = op_name
    for prefix in ("aten::", "aten."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return name.split(".", 1)[0]


def _lookup(name: str) -> OpClass | None:
    t = table()
    if name in t.exact:
        return t.exact[name]
    for pattern, cls in t.patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return cls
    return None


@cache
def lookup(op_name: str) -> OpClass | None:
    """The class of `op_name`, or None when the table does not know it."""
    name = base_name(op_name)
    candidates = [name]
    if name.endswith("_") and not name.startswith("_"):
        candidates.append(name.rstrip("_"))  # in place: add_ -> add
    for suffix in _BACKWARD_SUFFIXES:
        if name.endswith(suffix):
            candidates.append(name[: -len(suffix)])  # gelu_backward -> gelu
    for candidate in candidates:
        cls = _lookup(candidate)
        if cls is not None:
            return cls
    return None


def classify(op_name: str) -> OpClass:
    """The class of `op_name`; an operator the table does not know is OTHER (see `is_known`)."""
    return lookup(op_name) or OpClass.OTHER


def is_known(op_name: str) -> bool:
    return lookup(op_name) is not None or is_view(op_name)


@cache
def is_view(op_name: str) -> bool:
    """True for ops that only re-view storage: no kernel, no bytes moved."""
    return base_name(op_name) in table().views
