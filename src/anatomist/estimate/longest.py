"""The longest sequence a recipe trains at on a GPU (`longest_sequence`): `estimate --longest-seq-len`.

The lengths tried are multiples of `LENGTH_STEP` up to the model's longest (its position embeddings' limit, else
`NO_LIMIT_CAP`), the last one the limit itself. A step's memory grows with the length, so the longest that fits is
found by halving. Each length tried is a new set of traces, unless it is derived: the recipe's parts are traced at
three lengths, a quarter, a half and three quarters of the limit, and every length tried is derived from them
(`trace.depth.lengths`, exact where the step's sizes are polynomials in the length). The answer is then checked
against direct traces: the length found must fit and the next one up must not, and the derived device total at the
answer must be the direct one within `AGREEMENT`. Where that fails (or the recipe is not derivable:
`parts.derivable_in_length`), the search is run again on direct traces, and the result says so. Once checked, the
estimate at the answer is made within `LongestSequence.derivation`, which keeps the three lengths for the recipe's
parts: a later estimate at any length derives them from the cache without tracing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from anatomist.errors import InputError
from anatomist.estimate.memory import MemoryEstimate, estimate_memory
from anatomist.estimate.traces import Mode
from anatomist.hardware import GPU
from anatomist.recipe import Recipe
from anatomist.trace.depth.lengths import LENGTH_STEP
from anatomist.trace.store.parts import at_length, derivable_in_length, lengths_derived_from
from anatomist.workload import Workload

NO_LIMIT_CAP = 262_144
"""The longest length searched for a model whose config sets no limit on its positions."""
AGREEMENT = 0.001
"""How close the derived device total at the answer must be to the direct trace's (a share of it)."""


@dataclass(frozen=True, slots=True)
class LongestSequence:
    """What the search found, and how."""

    tokens: int
    """The longest length that fits (a multiple of `step`, or the limit); 0 where not even `step` tokens fit."""
    limit: int
    """The longest length searched: the model's, else `NO_LIMIT_CAP`."""
    limit_is_the_models: bool
    step: int
    next_tokens: int | None
    """The length tried above `tokens` (`tokens` + `step`, or the limit; None where `tokens` is the limit)."""
    next_device_total: int | None
    """The device total at `next_tokens`: what did not fit."""
    derived_from: tuple[int, int, int] | None
    """The three lengths traced, every other one tried derived from them; None where each was traced."""
    derived: int
    """How many lengths were tried on derived traces."""
    traced: tuple[int, ...]
    """The lengths tried on direct traces: the check of the derived answer, or every one tried."""
    why_traced: str = ""
    """Why every length was tried on direct traces ("" where derived)."""

    def derivation(self) -> AbstractContextManager[None]:
        """Within: an estimate at any length derives its parts from the three lengths the search checked, and keeps
        that it does in the trace cache (`parts.lengths_derived_from(keep=True)`): a later estimate of the recipe at
        another length is answered from the cache."""
        return lengths_derived_from(self.derived_from, keep=True) if self.derived_from else contextlib.nullcontext()

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "limit": self.limit, "limit_is_the_models": self.limit_is_the_models,
                "step": self.step, "next_tokens": self.next_tokens,
                "next_device_total": self.next_device_total, "derived_from": list(self.derived_from or ()),
                "derived": self.derived, "traced": list(self.traced), "why_traced": self.why_traced or None}


def longest_sequence(workload: Workload, recipe: Recipe, gpu: GPU, *, mode: Mode = "train", num_gpus: int = 1,
                     margin: float) -> LongestSequence:
    """The longest sequence `recipe` (its per-device batch) fits on `gpu` with `margin` kept free (module docstring).

    Raises:
        InputError: a recipe whose samples are not `--seq-len` tokens (padding-free: the data's own lengths).
    """
    check_length_search(recipe)
    limit = workload.max_positions or NO_LIMIT_CAP
    grid = [*range(LENGTH_STEP, limit + 1, LENGTH_STEP), *([limit] if limit % LENGTH_STEP else [])]
    memory: dict[tuple[int, bool], MemoryEstimate] = {}

    def memory_at(length: int, derived: bool) -> MemoryEstimate:
        if (length, derived) not in memory:
            at = at_length(workload, length)
            memory[length, derived] = estimate_memory(at, recipe.resolved(at), gpu, mode=mode, num_gpus=num_gpus,
                                                      margin=margin)
        return memory[length, derived]

    basis = _basis(limit)
    derivable = basis is not None and derivable_in_length(workload, recipe.resolved(workload))
    why = "" if derivable else "the recipe's sizes are not derived across lengths" if basis else "the limit is short"
    if derivable:
        assert basis is not None
        with lengths_derived_from(basis):
            found = _longest(grid, lambda n: memory_at(n, True).fits)
        why = _disagreement(grid, found, memory_at)
    if why:
        found = _longest(grid, lambda n: memory_at(n, False).fits)
    above = grid[found + 1] if found + 1 < len(grid) else None
    return LongestSequence(tokens=grid[found] if found >= 0 else 0, limit=limit, limit_is_the_models=bool(workload.max_positions),
                           step=LENGTH_STEP, next_tokens=above,
                           next_device_total=_device_total(memory_at(above, False)) if above else None,
                           derived_from=None if why else basis, derived=sum(derived for _, derived in memory),
                           traced=tuple(sorted(n for n, derived in memory if not derived)), why_traced=why)


def check_length_search(recipe: Recipe) -> None:
    """Refuse a search of the length where the samples have none of their own.

    Raises:
        InputError: padding-free training (not packed), whose samples are the data's own lengths.
    """
    if recipe.padding_free and not recipe.packing:
        raise InputError("--longest-seq-len searches the length every sample is padded or packed to; padding_free "
                         "trains on the data's own lengths (--avg-seq-len, --lengths): drop one of them")


def _basis(limit: int) -> tuple[int, int, int] | None:
    """Three lengths, multiples of LENGTH_STEP, at a quarter, a half and three quarters of `limit`; None where it is
    too short for three."""
    quarter = limit // 4 // LENGTH_STEP * LENGTH_STEP
    return (quarter, 2 * quarter, 3 * quarter) if quarter >= LENGTH_STEP else None


def _longest(grid: list[int], fits: Callable[[int], bool]) -> int:
    """The index in `grid` of the longest length that fits, by halving (-1 where none does)."""
    lo, hi = -1, len(grid)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(grid[mid]) else (lo, mid)
    return lo


def _disagreement(grid: list[int], found: int, memory_at: Callable[[int, bool], MemoryEstimate]) -> str:
    """Why direct traces do not confirm the derived answer `found`: "" where they do (module docstring)."""
    at = grid[max(found, 0)]
    derived, direct = (_device_total(memory_at(at, derived)) for derived in (True, False))
    if abs(derived - direct) > AGREEMENT * direct:
        return f"derived at {at:,} tokens, the device total was {derived / direct - 1:+.2%} off a direct trace's"
    if (found >= 0) != memory_at(at, False).fits:
        return f"a direct trace at {at:,} tokens did not confirm the derived answer"
    if found + 1 < len(grid) and memory_at(grid[found + 1], False).fits:
        return f"a direct trace at {grid[found + 1]:,} tokens fits, where the derived one did not"
    return ""


def _device_total(memory: MemoryEstimate) -> int:
    total = memory.anatomy.device_total
    assert total is not None  # a prediction always has one
    return total
