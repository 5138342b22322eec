"""`anatomist calibrate`: fit the time model to bench rows measured on a GPU."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from anatomist.cli.common import print_json
from anatomist.cli.render import console
from anatomist.errors import InputError
from anatomist.measure.records import records_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="fit the step-time model to `anatomist bench` rows measured on a GPU")
    p.add_argument("results", metavar="RESULTS", nargs="?", default=None,
                   help="a bench results file (JSONL) with rows run on one GPU")
    # issue 24's hook: the run records AnatomistCallback / track() keep, read as bench rows
    p.add_argument("--records", metavar="PATH", nargs="?", const="", default=None,
                   help="also read the run records AnatomistCallback and track() keep (default "
                        "<user cache>/calibration/runs.jsonl)")
    p.add_argument("-o", "--output", metavar="PATH", help="write the calibration file (use it with --calibration PATH)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout, nothing else")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from anatomist.bench.calibrate import calibrate
    from anatomist.estimate.time import calibration_toml

    if args.results is None and args.records is None:
        raise InputError("calibrate needs RESULTS (a bench results file) or --records (runs this machine watched)")
    records = None if args.records is None else args.records or records_path()
    result = calibrate(args.results, records=records)
    if args.output:
        Path(args.output).write_text(calibration_toml(result.calibration))
    if args.json:
        print_json({"gpu": result.gpu, "calibration": asdict(result.calibration), "rows": result.rows})
        return 0
    out = console()
    cal = result.calibration
    out.print(f"[bold]{result.gpu}[/]: fitted to {len(result.rows)} rows of "
              f"{' and '.join(str(s) for s in (args.results, records) if s is not None)}")
    out.print(f"  tensor-core contraction efficiency {cal.contraction_tensor_core_efficiency:.3f}, fp32 contraction "
              f"{cal.contraction_fp32_efficiency:.3f}, bandwidth {cal.bandwidth_efficiency:.3f}, "
              f"launch overhead {cal.launch_overhead_s * 1e6:.1f} us")
    table = Table(title="step time, measured vs fitted", title_justify="left")
    for col in ("row", "measured", "fitted", "error"):
        table.add_column(col, justify="left" if col == "row" else "right")
    for r in result.rows:
        table.add_row(r["name"], f"{r['measured_step_s'] * 1e3:,.1f} ms", f"{r['fitted_step_s'] * 1e3:,.1f} ms",
                      f"{r['error_pct']:+.1f}%")
    out.print(table)
    if args.output:
        out.print(f"calibration written to {args.output}; use it with --calibration {args.output}")
    return 0
