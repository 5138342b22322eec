"""`anatomist report`: draw estimate / plan / bench / profile results into one HTML file."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write one self-contained HTML report with charts")
    p.add_argument("results", metavar="RESULTS", nargs="+",
                   help="bench results (JSONL), or the --json output of estimate, plan or profile; several are combined")
    p.add_argument("-o", "--output", default="report.html", metavar="PATH", help="HTML file to write (default report.html)")
    p.add_argument("--png", metavar="DIR", default=None, help="also write each chart as DIR/<chart>.png")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from anatomist.report import write_report  # matplotlib: only when a report is made

    out = write_report(args.results if len(args.results) > 1 else args.results[0], args.output, png_dir=args.png)
    print(f"report written to {out}")
    return 0
