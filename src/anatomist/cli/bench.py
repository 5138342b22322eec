"""`anatomist bench`: run a suite of recipes for real, each in a fresh process, and compare."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from anatomist.anatomy import MIB
from anatomist.cli.common import print_json, whole_number
from anatomist.cli.render import Column, console, print_table
from anatomist.errors import InputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a suite of recipes for real and compare with the prediction")
    p.add_argument("--suite", default="seeds", metavar="NAME|FILE", help="shipped suite name or YAML file (default seeds)")
    p.add_argument("--model", default=None, metavar="MODEL", help="run the suite on this model instead")
    p.add_argument("--results", default="anatomist-results.jsonl", metavar="PATH",
                   help="JSONL results file, appended row by row (default anatomist-results.jsonl)")
    p.add_argument("--resume", action="store_true", help="skip rows already in the results file")
    p.add_argument("--rows", default=None, metavar="NAMES", help="comma-separated row names to run (default all)")
    p.add_argument("--num-processes", type=whole_number, default=None, metavar="N",
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


RESULT_COLUMNS = (Column(name="row", whole=True), Column(name="status"), Column(name="samples/s", right=True),
                  Column(name="peak alloc MiB", right=True), Column(name="predicted MiB", right=True),
                  Column(name="error", right=True), Column(name="reason"))
MULTI_PROCESS_CAPTION = ("NAME xN: N processes; peak alloc per rank (r0 / r1 / ...), predicted per process, "
                         "error of the largest rank")


def results_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The results table's cells, one row per result (the reason whole: a pipe shows it all, a terminal folds it)."""
    out = []
    for r in rows:
        predicted = (r.get("predicted") or {}).get("memory") or {}
        sps = (r.get("measured") or {}).get("samples_per_second")
        out.append([_row_label(r), r["status"], "-" if sps is None else f"{sps:.2f}", _measured_peak(r),
                    _fmt_mib(predicted.get("peak_allocated")),
                    _fmt_pct((r.get("error_pct") or {}).get("peak_allocated")), r.get("reason") or ""])
    return out


def _caption(rows: list[dict[str, Any]]) -> str | None:
    return MULTI_PROCESS_CAPTION if any(r.get("num_processes", 1) > 1 for r in rows) else None


def live_table(rows: list[dict[str, Any]], title: str) -> Table:
    """The rows finished so far, as the terminal's live view shows them while the suite runs."""
    table = Table(title=title, caption=_caption(rows))
    for c in RESULT_COLUMNS:
        table.add_column(c.name, justify="right" if c.right else "left", no_wrap=c.name != "reason",
                         overflow="fold", min_width=16 if c.name == "reason" else None)
    for cells in results_rows(rows):
        table.add_row(*(Text(c) for c in cells))
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
    title = f"{suite.name} -> {args.results}"
    with _progress(err, title, len(rows)) as on_row:
        results = run_suite(run, rows, store, resume=args.resume, num_processes=num_processes, on_row=on_row)
    if args.json:
        print_json({"rows": results})
    else:  # the table is the command's output: on stdout, whole where stdout is a file or a pipe
        print_table(console(), title, RESULT_COLUMNS, results_rows(results), caption=_caption(results))
    return 0


@contextlib.contextmanager
def _progress(err: Console, title: str, total: int) -> Iterator[Callable[[dict[str, Any], bool], None]]:
    """Progress on stderr while the suite runs: on a terminal, a bar over the rows finished (gone once the table is
    printed); elsewhere (a CI log) one line per row finished."""
    started = time.monotonic()
    if not err.is_terminal:
        done = [0]

        def said(row: dict[str, Any], reused: bool) -> None:
            done[0] += 1
            how = "kept from the results file" if reused else f"{time.monotonic() - started:,.0f} s in"
            err.print(f"bench: {done[0]}/{total} {_row_label(row)}: {row['status']} ({how})", markup=False)

        yield said
        return
    finished: list[dict[str, Any]] = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    task = progress.add_task(f"bench {title}", total=total)

    def view() -> Table:
        grid = Table.grid()
        grid.add_row(live_table(finished, title))
        grid.add_row(progress)
        return grid

    with Live(view(), console=err, refresh_per_second=4, transient=True, redirect_stdout=False) as live:

        def on_row(row: dict[str, Any], reused: bool) -> None:
            finished.append(row)
            progress.advance(task)
            live.update(view())

        yield on_row
