"""Which unit runs when: the order of the validation's units and the calls of a lent GPU they fall in.

A lent GPU gives a session 15 minutes in all, its start (1-2 minutes) included, in commands of at
most 10 minutes: validate.sh is called twice, `--budget-s 540,180` (this call 540 s; the plan shows
a later one of 180 s) and then `--budget-s 180`. Units run by priority, and within a priority in
the order of the parts (a-e) and of each part's units:

  1 first: the guide's bert-large rows (the seeds suite) and the memory of today's LLM recipes
  2 then:  the runtime overhead and the caching allocator probes (part a)
  3 rest:  pytest -m gpu, the other suites, the forward/backward grid, the time calibration

A unit starts only if the call still has its seconds left; one that does not fit waits for the next
call while smaller ones after it go on (first fit), and a unit that waits for a part (the calibration
waits for the bench rows) starts only once that part has nothing left to run. `pick` makes that
choice both for a real run (with the clock's seconds left) and for the plan (with the seconds it
adds up), so the plan is what a run does when each unit takes its seconds.

A unit's seconds: what a GPU measured when it last ran it (its `unit-done` marker's `elapsed_s` in
benchmarks/gpu/<device>/results.jsonl, written by the run), on this device, else the longest on
another one; else its expectation, an estimate from first principles (parts.py, suites.toml) that
the plan labels as such. A unit stopped by a call's end took at least what it had run (a
`unit-cut` record), which replaces a smaller expectation. A skipped unit's seconds (a row whose
package is missing) say nothing of a real run: they are not used.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from results import ResultsLog
from runner import Unit

PRIORITY_NAMES = {1: "first", 2: "then", 3: "rest"}
CALLS_S = (540.0, 180.0)
"""A lent GPU's two calls: 10 minutes less a minute for the command's start and end, then 3 minutes."""
CALL_START_S = 20.0
"""Expected seconds of a call before its first unit starts (carried wheels installed, units listed), until a
GPU run measures it (the env line's startup_s)."""


def unit_key(unit: Unit) -> str:
    return f"{unit.part}/{unit.name}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Seconds:
    """How long a unit is taken to last, and where that figure comes from."""

    value_s: float
    source: Literal["expected", "measured", "at least"]
    """expected: an estimate, no GPU has run the unit; measured: a GPU ran it; at least: a call's end cut it."""
    device: str | None = None
    """The GPU (results folder) that measured it, for measured and at least."""

    def label(self) -> str:
        if self.source == "expected":
            return f"{self.value_s:.0f} s expected (an estimate)"
        if self.source == "measured":
            return f"{self.value_s:.1f} s measured on {self.device}"
        return f">= {self.value_s:.0f} s (cut there by a call's end on {self.device})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """What GPU runs recorded of the units' durations, per results folder (device)."""

    done_s: Mapping[str, Mapping[str, float]]
    """device -> unit key -> seconds of its latest run that was not skipped."""
    cut_s: Mapping[str, Mapping[str, float]]
    """device -> unit key -> the longest a unit ran before a call's end stopped it."""
    startup_s: Mapping[str, float]
    """device -> seconds from the command's start to its first unit, in its latest GPU run."""


def read_measured(logs: Mapping[str, ResultsLog]) -> Measured:
    """The seconds GPU runs wrote in their logs (`logs`: device -> its results log); dry-run lines are left out."""
    done: dict[str, dict[str, float]] = {}
    cut: dict[str, dict[str, float]] = {}
    startup: dict[str, float] = {}
    for device, log in logs.items():
        for line in log.lines():
            if line.get("mode") != "gpu":
                continue
            record, seconds = line.get("record"), line.get("elapsed_s")
            if record == "env" and line.get("startup_s") is not None:
                startup[device] = float(line["startup_s"])
            if seconds is None:
                continue
            key = f"{line.get('part')}/{line.get('unit')}"
            if record == "unit-done" and line.get("status") != "skipped":
                done.setdefault(device, {})[key] = float(seconds)
            elif record == "unit-cut":
                cut.setdefault(device, {})[key] = max(float(seconds), cut.get(device, {}).get(key, 0.0))
    return Measured(done_s=done, cut_s=cut, startup_s=startup)


def seconds_of(unit: Unit, measured: Measured, device: str | None) -> Seconds:
    """The unit's seconds on `device`: measured there, else the longest measured elsewhere, else expected
    (raised to what a cut run already took)."""
    key = unit_key(unit)
    if device is not None and key in measured.done_s.get(device, {}):
        return Seconds(value_s=measured.done_s[device][key], source="measured", device=device)
    elsewhere = [(s[key], d) for d, s in measured.done_s.items() if key in s]
    if elsewhere:
        value, where = max(elsewhere)
        return Seconds(value_s=value, source="measured", device=where)
    cuts = [(s[key], d) for d, s in measured.cut_s.items() if key in s]
    if cuts and max(cuts)[0] > unit.expected_s:
        value, where = max(cuts)
        return Seconds(value_s=value, source="at least", device=where)
    return Seconds(value_s=float(unit.expected_s), source="expected")


def call_start_s(measured: Measured, device: str | None) -> tuple[float, bool]:
    """Seconds a call spends before its first unit, and whether a GPU measured them."""
    if device is not None and device in measured.startup_s:
        return measured.startup_s[device], True
    if measured.startup_s:
        return max(measured.startup_s.values()), True
    return CALL_START_S, False


def ordered(units: Iterable[Unit]) -> list[Unit]:
    """By priority; within one, in the order given (the parts', then each part's own)."""
    return sorted(units, key=lambda u: u.priority)


def pick(pending: Sequence[Unit], left_s: float, seconds: Callable[[Unit], float]) -> Unit | None:
    """The first unit of `pending` (in order) that fits in `left_s` and waits for no part with units pending."""
    waiting = {u.part for u in pending}
    for unit in pending:
        if any(part in waiting for part in unit.after):
            continue
        if seconds(unit) <= left_s:
            return unit
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One unit in the plan."""

    unit: Unit
    seconds: Seconds
    call: int | None
    """1, 2, ...: the call it runs in; None: done already, or in none of the calls planned."""
    done: bool
    why: str | None = None
    """Why it is in no call: too long for what the calls have left, or waiting for a part."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    device: str | None
    """The results folder (GPU) planned for; None: a GPU that has run nothing yet."""
    calls_s: tuple[float, ...]
    start_s: float
    start_measured: bool
    entries: tuple[Entry, ...]
    """Every unit, done ones included, in the order they run."""

    def in_call(self, call: int) -> list[Entry]:
        return [e for e in self.entries if e.call == call]

    def left_over(self) -> list[Entry]:
        return [e for e in self.entries if e.call is None and not e.done]


def make_plan(units: Sequence[Unit], done: set[str], measured: Measured, *, device: str | None,
              calls_s: Sequence[float] = CALLS_S) -> Plan:
    """Pack the units not `done` (unit keys) into calls of `calls_s` seconds, each less its start, by `pick`."""
    seconds = {unit_key(u): seconds_of(u, measured, device) for u in units}
    start_s, start_measured = call_start_s(measured, device)
    pending = [u for u in ordered(units) if unit_key(u) not in done]
    calls: dict[str, int] = {}
    for call, budget_s in enumerate(calls_s, start=1):
        left_s = budget_s - start_s if budget_s else math.inf  # 0: no limit
        while (unit := pick(pending, left_s, lambda u: seconds[unit_key(u)].value_s)) is not None:
            pending.remove(unit)
            calls[unit_key(unit)] = call
            left_s -= seconds[unit_key(unit)].value_s
    room_s = math.inf if 0 in calls_s else max(calls_s, default=0.0) - start_s
    waiting, left_over = {u.part for u in pending}, {unit_key(u) for u in pending}
    entries = []
    for unit in ordered(units):
        key = unit_key(unit)
        why = None
        if key in left_over:
            parts = [p for p in unit.after if p in waiting]
            if parts:
                why = f"waits for part {', '.join(parts)} to finish"
            elif seconds[key].value_s > room_s:
                why = f"longer than a call ({room_s:.0f} s after its start)"
            else:
                why = "no room left in these calls"
        entries.append(Entry(unit=unit, seconds=seconds[key], call=calls.get(key), done=key in done, why=why))
    order = {key: i for i, key in enumerate(calls)}  # the order the calls run them in
    entries.sort(key=lambda e: (0, order[unit_key(e.unit)]) if unit_key(e.unit) in order else (1, 0))
    return Plan(device=device, calls_s=tuple(calls_s), start_s=start_s, start_measured=start_measured,
                entries=tuple(entries))


def render(plan: Plan) -> str:
    """The plan as a person reads it: each unit with its priority, seconds and call, then what does not fit."""
    where = plan.device or "a GPU that has run none of it yet"
    calls = " then ".join(f"{s:.0f} s" if s else "no limit" for s in plan.calls_s)
    start = "measured" if plan.start_measured else "expected"
    lines = [f"plan for {where}: calls of {calls} (--budget-s), each less {plan.start_s:.0f} s of its own start "
             f"({start}); a unit's seconds are an estimate until a GPU has run it, then what it measured"]
    rows = [(f"call {e.call}", f"{e.unit.priority} {PRIORITY_NAMES.get(e.unit.priority, '')}".strip(),
             unit_key(e.unit), e.seconds.label()) for e in plan.entries if e.call is not None]
    rows += [("no call", f"{e.unit.priority} {PRIORITY_NAMES.get(e.unit.priority, '')}".strip(), unit_key(e.unit),
              f"{e.seconds.label()}: {e.why}") for e in plan.left_over()]
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
              for r in rows]
    for call, budget_s in enumerate(plan.calls_s, start=1):
        entries = plan.in_call(call)
        total_s = sum(e.seconds.value_s for e in entries)
        room = f"{budget_s - plan.start_s:.0f} s" if budget_s else "no limit"
        lines.append(f"call {call}: {len(entries)} unit(s), {total_s:.0f} s of {room}")
    done = [e for e in plan.entries if e.done]
    left = plan.left_over()
    lines.append(f"done already: {len(done)} unit(s); in no call: {len(left)} unit(s), "
                 f"{sum(e.seconds.value_s for e in left):.0f} s (a later call or session goes on with them)")
    return "\n".join(lines)
