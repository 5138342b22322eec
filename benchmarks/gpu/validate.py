"""Every GPU check of anatomist in one resumable command (called by validate.sh).

    python benchmarks/gpu/validate.py [--dry-run | --plan] [--part a,c] [--redo d] [--out DIR]
                                      [--budget-s 540,180] [--device SLUG] [--copy-to DIR]

Runs the units of parts a-e (parts.py) by priority (plan.py: the guide's bert-large rows and the
memory of today's LLM recipes first, then the runtime overhead and allocator probes, then the rest),
each only if this invocation's budget (the first number of --budget-s, counted from the command's
start) still covers its seconds: what a GPU measured when it last ran it, else its expectation. A
unit that does not fit waits for the next call while smaller ones go on. Each unit's rows go to
DIR/results.jsonl as they are made (flush + fsync), followed by a `unit-done` marker with the
seconds it took; a rerun skips units with a marker, so a run cut at a lent GPU's 10-minute limit
loses at most the unit in progress. A unit that fails is recorded (an error row and its marker) and
the run goes on; `--redo PART` runs a part's units again. At the end, DIR/table.md and
DIR/gpus-snippet.toml are rebuilt from the log.

Before it runs anything it prints the plan: each unit, its priority, its seconds and the call it
falls in (the numbers after the first of --budget-s are the later calls), and what fits in none.
`--plan` prints it and stops; `--dry-run` prints the plan of a lent GPU, then runs the same plumbing
on the CPU with tiny models (no CUDA, no network).

DIR is benchmarks/gpu/<device>/ (e.g. H100-80GB-HBM3) on a GPU, build/gpu-validate-dry-run/ for
`--dry-run`. Exit code 0 when the run went through (failed units are results), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

from environment import Device, cpu_device, nvml_device, versions
from parts import PARTS
from plan import CALLS_S, make_plan, ordered, pick, read_measured, render, seconds_of, unit_key
from report import write_snippet, write_table
from results import ResultsLog, new_attempt
from runner import Budget, Context, Outcome, Unit

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PART_ALIASES = {str(i + 1): name for i, name in enumerate(PARTS)}
OUTPUT_FILES = ("results.jsonl", "table.md", "gpus-snippet.toml", "bench.jsonl", "time-calibration.toml")
STARTED_AT_ENV = "VALIDATE_STARTED_AT"
"""validate.sh's start (time.time()), so that the budget counts the command's own start too."""


class Parser(argparse.ArgumentParser):
    """Bad flags are one line on stderr and exit code 2 (argparse prints its usage too)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_parts(text: str | None, parser: argparse.ArgumentParser) -> list[str]:
    """'a,c' or '1,3' -> ['a', 'c']; None -> every part."""
    if text is None:
        return list(PARTS)
    names = [PART_ALIASES.get(p.strip(), p.strip()) for p in text.split(",") if p.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)} (or 1-{len(PARTS)})")
    return [p for p in PARTS if p in names]


def parse_budgets(text: str, parser: argparse.ArgumentParser) -> tuple[float, ...]:
    """'540,180' -> (540.0, 180.0): this call's seconds, then the later calls' (for the plan); 0: no limit."""
    try:
        budgets = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        budgets = ()
    if not budgets or any(b < 0 for b in budgets):
        parser.error(f"--budget-s takes seconds >= 0, comma-separated (this call's, then later ones'), got {text!r}")
    return budgets


def progress(log: ResultsLog, ctx: Context) -> dict[str, str]:
    """part -> 'done' / 'k of n units' from the markers (listing units is cheap: no child runs)."""
    out = {}
    for name, part in PARTS.items():
        units = [u.name for u in part.units(ctx)]
        done = sum(1 for u in units if u in log.done_units(name))
        out[name] = "done" if done == len(units) else f"{done} of {len(units)} units"
    return out


def list_units(ctx: Context, parts: list[str]) -> list[Unit]:
    return [unit for name in parts for unit in PARTS[name].units(ctx)]


def done_keys(log: ResultsLog, parts: list[str]) -> set[str]:
    return {f"{name}/{unit}" for name in parts for unit in log.done_units(name)}


def gpu_logs(exclude: Path | None = None) -> dict[str, ResultsLog]:
    """Every GPU's results log under benchmarks/gpu/ (one folder per device), by folder name."""
    logs = {}
    for path in sorted(HERE.glob("*/results.jsonl")):
        if exclude is None or path.parent.resolve() != exclude.resolve():
            logs[path.parent.name] = ResultsLog(path=path)
    return logs


def latest_gpu_folder() -> Path | None:
    """The device folder whose last GPU run is the latest (what a plan without a GPU resumes from)."""
    latest: tuple[str, Path] | None = None
    for log in gpu_logs().values():
        envs = [line for line in log.lines() if line.get("record") == "env" and line.get("mode") == "gpu"]
        if envs and (latest is None or str(envs[-1]["time"]) > latest[0]):
            latest = (str(envs[-1]["time"]), log.path.parent)
    return latest[1] if latest else None


def plan_text(ctx: Context, parts: list[str], budgets: tuple[float, ...], folder: Path | None) -> str:
    """The plan of a GPU run whose results go to `folder` (None: a GPU that has run nothing yet)."""
    gpu_ctx = dataclasses.replace(ctx, dry_run=False, out_dir=folder or ctx.out_dir)
    logs = gpu_logs(exclude=folder)
    done: set[str] = set()
    if folder is not None:
        logs[folder.name] = ResultsLog(path=folder / "results.jsonl")
        done = done_keys(logs[folder.name], parts)
    plan = make_plan(list_units(gpu_ctx, parts), done, read_measured(logs),
                     device=folder.name if folder else None, calls_s=budgets)
    return render(plan)


def run_units(ctx: Context, parts: list[str], device: str | None, copy: Path | None) -> str | None:
    """Run the units not done yet, by priority, while they fit; returns why units are left, or None."""
    # a dry run's units are the CPU's: no GPU's seconds say anything of them
    measured = read_measured({} if ctx.dry_run else {**gpu_logs(exclude=ctx.out_dir), **({device: ctx.log} if device
                                                                                          else {})})
    done = done_keys(ctx.log, parts)
    units = ordered(list_units(ctx, parts))
    for skipped in units:
        if unit_key(skipped) in done:
            marker = ctx.log.done_units(skipped.part)[skipped.name]
            print(f"validate {unit_key(skipped)}: done already ({marker['status']}), skipped", file=sys.stderr)
    pending = [u for u in units if unit_key(u) not in done]
    seconds = {unit_key(u): seconds_of(u, measured, device) for u in pending}
    while (unit := pick(pending, ctx.budget.remaining_s(), lambda u: seconds[unit_key(u)].value_s)) is not None:
        pending.remove(unit)
        left_s = ctx.budget.remaining_s()
        timeout_s = min(unit.cap_s, left_s)
        attempt, start = new_attempt(), time.monotonic()
        print(f"validate {unit_key(unit)} (priority {unit.priority}, {seconds[unit_key(unit)].label()}; attempt "
              f"{attempt}, up to {timeout_s:.0f} s)", file=sys.stderr)
        try:
            outcome = unit.run(ctx, unit, attempt, timeout_s)
        except Exception as exc:  # noqa: BLE001 - a crash of the driver's own code is a result too
            outcome = Outcome(status="error", note=f"{type(exc).__name__}: {str(exc)[:300]}")
        elapsed_s = round(time.monotonic() - start, 1)
        if outcome.status == "incomplete":
            # no marker: it runs again next time; its seconds so far are a floor for the plan
            ctx.log.append({"record": "unit-cut", "part": unit.part, "unit": unit.name, "attempt": attempt,
                            "mode": ctx.mode, "elapsed_s": elapsed_s, "note": outcome.note})
            return f"{unit_key(unit)}: {outcome.note}; run again to go on"
        if outcome.status == "error":
            ctx.log.row(part=unit.part, unit=unit.name, attempt=attempt, name=unit.name, status="error",
                        mode=ctx.mode, reason=outcome.note)
        ctx.log.append({"record": "unit-done", "part": unit.part, "unit": unit.name, "attempt": attempt,
                        "status": outcome.status, "note": outcome.note, "mode": ctx.mode, "elapsed_s": elapsed_s})
        print(f"validate {unit_key(unit)}: {outcome.status} in {elapsed_s} s"
              + (f" ({outcome.note})" if outcome.note else ""), file=sys.stderr)
        if copy is not None:  # a command killed at its limit still returns what is there
            copy_out(ctx.out_dir, copy, quiet=True)
    if pending:
        return (f"{len(pending)} unit(s) left ({', '.join(unit_key(u) for u in pending[:5])}"
                f"{', ...' if len(pending) > 5 else ''}): not enough of this call's budget left; run again to go on")
    return None


def copy_out(out_dir: Path, dest: Path, *, quiet: bool = False) -> None:
    """Copy the result files (flat, no subfolders) to dest (e.g. a lent GPU's $OUT/<device>)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        if (out_dir / name).is_file():
            shutil.copy2(out_dir / name, dest / name)
    if not quiet:
        print(f"validate: results copied to {dest}", file=sys.stderr)


def started_at() -> float:
    """time.monotonic() at validate.sh's start (from its time.time()), or now when it did not say."""
    try:
        wall = float(os.environ[STARTED_AT_ENV])
    except (KeyError, ValueError):
        return time.monotonic()
    return time.monotonic() - max(0.0, time.time() - wall)


def main(argv: list[str]) -> int:
    try:
        return validate(argv)
    except ValueError as exc:  # a corrupt results log or suites.toml: what to fix, in one line
        print(f"validate: error: {exc}", file=sys.stderr)
        return 2


def validate(argv: list[str]) -> int:
    parser = Parser(prog="validate.sh", description="anatomist's GPU checks, resumable.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="print a lent GPU's plan, then run the plumbing on the CPU with tiny models")
    mode.add_argument("--plan", action="store_true", help="print the plan of a GPU run and stop (no GPU needed)")
    parser.add_argument("--part", help="parts to run, e.g. a,c or 1,3 (default: all not done)")
    parser.add_argument("--redo", help="parts whose units run again even if done, e.g. d")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/gpu/<device>/)")
    parser.add_argument("--budget-s", default=",".join(f"{s:.0f}" for s in CALLS_S),
                        help="seconds this call may use from its start (default 540: a lent GPU's 10-minute command "
                             "less a minute), then, comma-separated, those of the later calls the plan shows (default "
                             "540,180); 0 for no limit")
    parser.add_argument("--device", help="with --plan or --dry-run: the results folder under benchmarks/gpu/ to plan "
                                         "for (default: this GPU's, else the one run last, else none)")
    parser.add_argument("--copy-to", type=Path, help="also copy the result files to DIR/<device>/ (e.g. $OUT), after "
                                                     "every unit")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the child processes")
    args = parser.parse_args(argv)
    budgets = parse_budgets(args.budget_s, parser)
    if args.device is not None and (not args.device or Path(args.device).name != args.device):
        parser.error(f"--device takes a folder name under benchmarks/gpu/ (e.g. H100-80GB-HBM3), got {args.device!r}")
    parts, redo = parse_parts(args.part, parser), parse_parts(args.redo, parser) if args.redo else []
    # anatomist's cache (traces, TrainingArguments' defaults) in a folder of the run's own: the GPU image has no
    # platformdirs, which finds the user's cache folder otherwise, and the units share what it holds
    os.environ.setdefault("ANATOMIST_CACHE_DIR", str(Path(tempfile.gettempdir()) / "anatomist-validate-cache"))
    gpu = None if args.dry_run else nvml_device()
    if gpu is None and not (args.dry_run or args.plan):
        print("validate: error: no NVIDIA GPU found through NVML; on a machine without one, run with --dry-run or "
              "--plan", file=sys.stderr)
        return 2
    device: Device = gpu or cpu_device()
    out_dir = args.out or (REPO / "build" / "gpu-validate-dry-run" if args.dry_run else HERE / device.slug)
    log = ResultsLog(path=out_dir / "results.jsonl")
    ctx = Context(repo=REPO, here=HERE, out_dir=out_dir, log=log, dry_run=args.dry_run, python=args.python,
                  budget=Budget(total_s=budgets[0] or None, start_s=started_at()))
    selected = sorted(set(parts) | set(redo), key=list(PARTS).index)

    if args.device:
        folder: Path | None = HERE / args.device
    elif args.dry_run:
        folder = latest_gpu_folder()
    else:
        folder = out_dir if gpu is not None or args.out else latest_gpu_folder()
    if args.plan:
        print(plan_text(ctx, selected, budgets, folder))
        return 0
    if args.dry_run:
        print("validate: what a lent GPU would run (--budget-s " + args.budget_s + "):\n"
              + plan_text(ctx, selected, budgets, folder), file=sys.stderr)

    log.repair()
    for name in redo:
        log.append({"record": "redo", "part": name})
        if name == "c" and ctx.bench_results.is_file():  # else `bench --resume` would reuse its old rows
            ctx.bench_results.rename(ctx.bench_results.with_suffix(f".{new_attempt()}.jsonl"))
    startup_s = round(time.monotonic() - ctx.budget.start_s, 1)
    log.append({"record": "env", "mode": ctx.mode, "device": device.to_dict(), "versions": versions(),
                "argv": argv, "startup_s": startup_s, "budget_s": budgets[0] or None})
    if not args.dry_run:
        print(f"validate: {plan_text(ctx, selected, budgets, out_dir)}", file=sys.stderr)
    print(f"validate: {device.name} ({ctx.mode}), results in {out_dir}", file=sys.stderr)
    copy = args.copy_to / device.slug if args.copy_to else None
    stopped = run_units(ctx, selected, device.slug if gpu is not None else None, copy)
    state = progress(log, ctx)
    table = write_table(log, out_dir, state)
    write_snippet(log, out_dir)
    print(f"validate: {table} ({', '.join(f'{p} {s}' for p, s in state.items())})", file=sys.stderr)
    if stopped:
        print(f"validate: stopped early: {stopped}", file=sys.stderr)
    if copy is not None:
        copy_out(out_dir, copy)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
