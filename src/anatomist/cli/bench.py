"""`anatomist bench`: run a suite of recipes for real, each in a fresh process, and compare."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from anatomist.anatomy import MIB
from anatomist.cli.common import print_json
from anatomist.cli.render import console
from anatomist.errors import InputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a suite of recipes for real and compare with the prediction")
    p.add_argument("--suite", default="seeds", metavar="NAME|FILE", help="shipped suite name or YAML file (default seeds)")
    p.add_argument("--model", default=None, metavar="MODEL", help="run the suite on this model instead")
    p.add_argument("--results", default="anatomist-results.jsonl", metavar="PATH",
                   help="JSONL results file, appended row by row (default anatomist-results.jsonl)")
    p.add_argument("--resume", action="store_true", help="skip rows already in the results file")
    p.add_argument("--rows", default=None, metavar="NAMES", help="comma-separated row names to run (default all)")
    p.add_argument("--num-processes", type=int, default=1, metavar="N", help="processes per row (>1: distributed)")
    p.add_argument("--json", action="store_true", help='print {"rows": [...]} on stdout, nothing else')
    p.set_defaults(handler=run)


def _fmt_mib(value: Any) -> str:
    return "-" if value is None else f"{value / MIB:,.1f}"


def _fmt_pct(value: Any) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def results_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for col in ("row", "status", "samples/s", "peak alloc MiB", "predicted MiB", "error"):
        table.add_column(col, justify="left" if col in ("row", "status") else "right", no_wrap=True)
    table.add_column("reason", overflow="fold", min_width=16)
    for r in rows:
        measured = (r.get("measured") or {}).get("memory") or {}
        predicted = (r.get("predicted") or {}).get("memory") or {}
        sps = (r.get("measured") or {}).get("samples_per_second")
        table.add_row(
            r["name"], r["status"], "-" if sps is None else f"{sps:.2f}", _fmt_mib(measured.get("peak_allocated")),
            _fmt_mib(predicted.get("peak_allocated")), _fmt_pct((r.get("error_pct") or {}).get("peak_allocated")),
            (r.get("reason") or "")[:48],
        )
    return table


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: every subcommand's module is imported to build the parser.
    from anatomist.bench.runner import prepare_suite, run_suite
    from anatomist.bench.store import open_results
    from anatomist.bench.suites import load_suite

    if args.num_processes < 1:
        raise InputError(f"--num-processes must be at least 1, got {args.num_processes}")
    if args.num_processes > 1:
        return _run_distributed(args)
    suite = load_suite(args.suite)
    names = [n.strip() for n in args.rows.split(",") if n.strip()] if args.rows else None
    rows = suite.select(names)
    run = prepare_suite(suite, args.model)
    store = open_results(args.results)  # validates an existing file before anything runs
    err = console(stderr=True)
    if run.on_cpu:
        err.print(f"[bold]No GPU here:[/] running suite {suite.name!r} on its small CPU configuration "
                  f"({run.model_label}, {run.num_samples} samples of {run.seq_len} tokens); "
                  "no GPU figure is measured.")
    finished: list[dict[str, Any]] = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    task = progress.add_task(f"bench {suite.name}", total=len(rows))

    def view() -> Table:
        grid = Table.grid()
        grid.add_row(results_table(finished, f"{suite.name} -> {args.results}"))
        grid.add_row(progress)
        return grid

    with Live(view(), console=err, refresh_per_second=4, transient=False, redirect_stdout=False) as live:

        def on_row(row: dict[str, Any], reused: bool) -> None:
            finished.append(row)
            progress.advance(task)
            live.update(view())

        results = run_suite(run, rows, store, resume=args.resume, on_row=on_row)
    if args.json:
        print_json({"rows": results})
    return 0


def _run_distributed(args: argparse.Namespace) -> int:
    """--num-processes N: one recipe (--rows NAME) of --model MODEL through `accelerate launch`."""
    from anatomist.bench.distributed import run_distributed
    from anatomist.bench.suites import load_suite

    names = [n.strip() for n in args.rows.split(",") if n.strip()] if args.rows else []
    if args.model is None or len(names) != 1:
        raise InputError("--num-processes > 1 runs one recipe on one model: give --model MODEL and --rows NAME")
    (row,) = load_suite(args.suite).select(names)
    result = run_distributed(args.model, row.recipe, args.num_processes)
    json.dump(result, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    return 0
