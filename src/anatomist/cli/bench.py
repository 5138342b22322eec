"""`anatomist bench`: run a suite of recipes for real, each in a fresh process, and compare."""

from __future__ import annotations

import argparse
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
    p.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="processes per row (>1: distributed: torchrun for FSDP rows, accelerate launch otherwise); "
                        "default: the suite's num_processes, else 1")
    p.add_argument("--json", action="store_true", help='print {"rows": [...]} on stdout, nothing else')
    p.set_defaults(handler=run)


def _fmt_mib(value: Any) -> str:
    return "-" if value is None else f"{value / MIB:,.1f}"


def _fmt_pct(value: Any) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def _measured_peak(row: dict[str, Any]) -> str:
    """The measured peak allocated: one figure, or on several processes each rank's (r0 / r1 / ...)."""
    measured = row.get("measured") or {}
    ranks = measured.get("ranks")
    if ranks:
        return " / ".join(_fmt_mib((r.get("memory") or {}).get("peak_allocated")) for r in ranks)
    return _fmt_mib((measured.get("memory") or {}).get("peak_allocated"))


def _row_label(row: dict[str, Any]) -> str:
    processes = row.get("num_processes", 1)
    return row["name"] if processes == 1 else f"{row['name']} x{processes}"


def results_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for col in ("row", "status", "samples/s", "peak alloc MiB", "predicted MiB", "error"):
        table.add_column(col, justify="left" if col in ("row", "status") else "right", no_wrap=True)
    table.add_column("reason", overflow="fold", min_width=16)
    for r in rows:
        predicted = (r.get("predicted") or {}).get("memory") or {}
        sps = (r.get("measured") or {}).get("samples_per_second")
        table.add_row(
            _row_label(r), r["status"], "-" if sps is None else f"{sps:.2f}", _measured_peak(r),
            _fmt_mib(predicted.get("peak_allocated")), _fmt_pct((r.get("error_pct") or {}).get("peak_allocated")),
            (r.get("reason") or "")[:48],
        )
    if any(r.get("num_processes", 1) > 1 for r in rows):
        table.caption = ("NAME xN: N processes; peak alloc per rank (r0 / r1 / ...), predicted per process, "
                         "error of the largest rank")
    return table


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: every subcommand's module is imported to build the parser.
    from anatomist.bench.runner import DISTRIBUTED_STEPS, check_rows, prepare_suite, run_suite
    from anatomist.bench.store import open_results
    from anatomist.bench.suites import load_suite

    if args.num_processes is not None and args.num_processes < 1:
        raise InputError(f"--num-processes must be at least 1, got {args.num_processes}")
    suite = load_suite(args.suite)
    num_processes = args.num_processes or suite.num_processes
    names = [n.strip() for n in args.rows.split(",") if n.strip()] if args.rows else None
    rows = suite.select(names)
    run = prepare_suite(suite, args.model)
    check_rows(run, rows, num_processes)
    store = open_results(args.results)  # validates an existing file before anything runs
    err = console(stderr=True)
    if run.on_cpu:
        shape = (f"{run.seq_len} tokens per sample, {DISTRIBUTED_STEPS} optimizer steps on each of {num_processes} processes"
                 if num_processes > 1 else f"{run.num_samples} samples of {run.seq_len} tokens")
        err.print(f"[bold]No GPU here:[/] running suite {suite.name!r} on its small CPU configuration "
                  f"({run.model_label}, {shape}); no GPU figure is measured.")
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

        results = run_suite(run, rows, store, resume=args.resume, num_processes=num_processes, on_row=on_row)
    if args.json:
        print_json({"rows": results})
    return 0

