"""`anatomist calibrate`: fit the time model to bench rows measured on a GPU."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from anatomist.cli.common import print_json
from anatomist.cli.render import console
from anatomist.errors import InputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="fit the step-time model to `anatomist bench` rows measured on a GPU")
    p.add_argument("results", metavar="RESULTS", nargs="?", default=None,
                   help="a bench results file (JSONL) with rows run on one GPU")
    # the run records AnatomistCallback / track() keep, read as bench rows
    p.add_argument("--records", metavar="PATH", nargs="?", const="", default=None,
                   help="also read the run records AnatomistCallback and track() keep (default "
                        "<user cache>/calibration/runs.jsonl)")
    p.add_argument("-o", "--output", metavar="PATH", help="write the calibration file (use it with --calibration PATH)")
    p.add_argument("--install", action="store_true",
                   help="also install it as this user's calibration of that GPU (<cache>/calibration/<GPU>.toml): "
                        "estimate and plan then use it instead of the published one")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout, nothing else")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from anatomist.bench.calibrate import calibrate
    from anatomist.calibration.lookup import user_calibration_path
    from anatomist.calibration.measured import calibration_toml
    from anatomist.hardware import get_gpu
    from anatomist.measure.run_log import records_path  # anatomist.measure imports transformers

    if args.results is None and args.records is None:
        raise InputError("calibrate needs RESULTS (a bench results file) or --records (runs this machine watched)")
    records = None if args.records is None else args.records or records_path()
    result = calibrate(args.results, records=records)
    written = [Path(args.output)] if args.output else []
    if args.install:
        written.append(user_calibration_path(get_gpu(result.gpu)))
    for path in written:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(calibration_toml(result.calibration))
    if args.json:
        print_json({"gpu": result.gpu, "calibration": asdict(result.calibration), "rows": result.rows,
                    "written": [str(p) for p in written]})
        return 0
    out = console()
    cal = result.calibration
    out.print(f"[bold]{result.gpu}[/]: fitted to {len(result.rows)} rows of "
              f"{' and '.join(str(s) for s in (args.results, records) if s is not None)}")
    f = cal.factors
    out.print(f"  tensor-core efficiency {f.tensor_core_efficiency:.3f}, fp32 {f.fp32_efficiency:.3f}, bandwidth "
              f"{f.bandwidth_efficiency:.3f}, kernel overhead {f.kernel_overhead_s * 1e6:.1f} us, host overhead "
              f"{f.micro_batch_overhead_s * 1e3:.2f} ms per micro-batch, {f.host_op_s * 1e6:.1f} us per kernel issued")
    table = Table(title="step time, measured vs fitted", title_justify="left")
    for col in ("row", "measured", "fitted", "error"):
        table.add_column(col, justify="left" if col == "row" else "right")
    for r in result.rows:
        table.add_row(r["name"], f"{r['measured_step_s'] * 1e3:,.1f} ms", f"{r['fitted_step_s'] * 1e3:,.1f} ms",
                      f"{r['error_pct']:+.1f}%")
    out.print(table)
    if args.output:
        out.print(f"calibration written to {args.output}; use it with --calibration {args.output}")
    if args.install:
        out.print(f"installed as {written[-1]}: estimate and plan on {result.gpu} now use it (it wins over the "
                  "published calibration)")
    return 0
