"""Every GPU check of anatomist in one resumable command (called by validate.sh).

    python benchmarks/gpu/validate.py [--dry-run] [--part a,c] [--redo d] [--out DIR]
                                      [--budget-s 540] [--copy-to DIR]

Runs parts a-e (parts.py) unit by unit. Each unit's rows go to DIR/results.jsonl as they are
made (flush + fsync), followed by a `unit-done` marker; a rerun skips units with a marker, so
a run cut at the 10-minute limit of a lent GPU loses at most the unit in progress. A unit that
fails is recorded (an error row and its marker) and the run goes on with the next one; `--redo
PART` runs a part's units again. A unit starts only if the time budget still covers its expected
duration. At the end, DIR/table.md and DIR/gpus-snippet.toml are rebuilt from the log.

DIR is benchmarks/gpu/<device>/ (e.g. H100-80GB-HBM3) on a GPU, build/gpu-validate-dry-run/ for
`--dry-run`, which runs the same plumbing on the CPU with tiny models (no CUDA, no network).
Exit code 0 when the run went through (failed units are results), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from environment import Device, cpu_device, nvml_device, versions
from parts import PARTS
from report import write_snippet, write_table
from results import ResultsLog, new_attempt
from runner import Budget, Context, Outcome

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PART_ALIASES = {str(i + 1): name for i, name in enumerate(PARTS)}
OUTPUT_FILES = ("results.jsonl", "table.md", "gpus-snippet.toml", "bench.jsonl", "time-calibration.toml")


def parse_parts(text: str | None, parser: argparse.ArgumentParser) -> list[str]:
    """'a,c' or '1,3' -> ['a', 'c']; None -> every part."""
    if text is None:
        return list(PARTS)
    names = [PART_ALIASES.get(p.strip(), p.strip()) for p in text.split(",") if p.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)} (or 1-{len(PARTS)})")
    return [p for p in PARTS if p in names]


def progress(log: ResultsLog, ctx: Context) -> dict[str, str]:
    """part -> 'done' / 'k of n units' from the markers (listing units is cheap: no child runs)."""
    out = {}
    for name, part in PARTS.items():
        units = [u.name for u in part.units(ctx)]
        done = sum(1 for u in units if u in log.done_units(name))
        out[name] = "done" if done == len(units) else f"{done} of {len(units)} units"
    return out


def run_parts(ctx: Context, parts: list[str]) -> str | None:
    """Run the units not done yet; returns why the invocation stopped early, or None."""
    for name in parts:
        part = PARTS[name]
        done = ctx.log.done_units(name)
        print(f"validate {name}: {part.title}", file=sys.stderr)
        for unit in part.units(ctx):
            if unit.name in done:
                print(f"validate {name}: {unit.name}: done already ({done[unit.name]['status']}), skipped",
                      file=sys.stderr)
                continue
            left_s = ctx.budget.remaining_s()
            if left_s < unit.expected_s:
                return f"{left_s:.0f} s left, {name}/{unit.name} expects {unit.expected_s:.0f} s: run again to go on"
            timeout_s = min(unit.cap_s, left_s)
            attempt, start = new_attempt(), time.monotonic()
            print(f"validate {name}: {unit.name} (attempt {attempt}, up to {timeout_s:.0f} s)", file=sys.stderr)
            try:
                outcome = unit.run(ctx, unit, attempt, timeout_s)
            except Exception as exc:  # noqa: BLE001 - a crash of the driver's own code is a result too
                outcome = Outcome(status="error", note=f"{type(exc).__name__}: {str(exc)[:300]}")
            elapsed_s = round(time.monotonic() - start, 1)
            if outcome.status == "incomplete":
                return f"{name}/{unit.name}: {outcome.note}; run again to go on"
            if outcome.status == "error":
                ctx.log.row(part=name, unit=unit.name, attempt=attempt, name=unit.name, status="error",
                            mode=ctx.mode, reason=outcome.note)
            ctx.log.append({"record": "unit-done", "part": name, "unit": unit.name, "attempt": attempt,
                            "status": outcome.status, "note": outcome.note, "elapsed_s": elapsed_s})
            print(f"validate {name}: {unit.name}: {outcome.status} in {elapsed_s} s"
                  + (f" ({outcome.note})" if outcome.note else ""), file=sys.stderr)
    return None


def copy_out(out_dir: Path, target: Path, device: Device) -> None:
    """Copy the result files (flat, no subfolders) to target/<device slug>/, e.g. a lent GPU's $OUT."""
    dest = target / device.slug
    dest.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        if (out_dir / name).is_file():
            shutil.copy2(out_dir / name, dest / name)
    print(f"validate: results copied to {dest}", file=sys.stderr)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="validate.sh", description="anatomist's GPU checks, resumable.")
    parser.add_argument("--dry-run", action="store_true", help="run the plumbing on the CPU with tiny models")
    parser.add_argument("--part", help="parts to run, e.g. a,c or 1,3 (default: all not done)")
    parser.add_argument("--redo", help="parts whose units run again even if done, e.g. d")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/gpu/<device>/)")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="stop starting units after this many seconds (default 540: a lent GPU gives 600 per "
                             "command); 0 for no limit")
    parser.add_argument("--copy-to", type=Path, help="also copy the result files to DIR/<device>/ (e.g. $OUT)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the child processes")
    args = parser.parse_args(argv)
    parts, redo = parse_parts(args.part, parser), parse_parts(args.redo, parser) if args.redo else []
    device = cpu_device() if args.dry_run else nvml_device()
    if device is None:
        print("validate: error: no NVIDIA GPU found through NVML; on a machine without one, run with --dry-run",
              file=sys.stderr)
        return 2
    out_dir = args.out or (REPO / "build" / "gpu-validate-dry-run" if args.dry_run else HERE / device.slug)
    log = ResultsLog(path=out_dir / "results.jsonl")
    log.repair()
    ctx = Context(repo=REPO, here=HERE, out_dir=out_dir, log=log, dry_run=args.dry_run, python=args.python,
                  budget=Budget(total_s=args.budget_s or None))
    log.append({"record": "env", "mode": ctx.mode, "device": device.to_dict(), "versions": versions(),
                "argv": argv})
    for name in redo:
        log.append({"record": "redo", "part": name})
        if name == "c" and ctx.bench_results.is_file():  # else `bench --resume` would reuse its old rows
            ctx.bench_results.rename(ctx.bench_results.with_suffix(f".{new_attempt()}.jsonl"))
    print(f"validate: {device.name} ({ctx.mode}), results in {out_dir}", file=sys.stderr)
    stopped = run_parts(ctx, sorted(set(parts) | set(redo), key=list(PARTS).index))
    state = progress(log, ctx)
    table = write_table(log, out_dir, state)
    write_snippet(log, out_dir)
    print(f"validate: {table} ({', '.join(f'{p} {s}' for p, s in state.items())})", file=sys.stderr)
    if stopped:
        print(f"validate: stopped early: {stopped}", file=sys.stderr)
    if args.copy_to:
        copy_out(out_dir, args.copy_to, device)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
