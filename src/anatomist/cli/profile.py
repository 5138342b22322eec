"""`anatomist profile`: real training steps under torch.profiler, time split by operation class."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from anatomist.cli.common import add_model_flags, native_log_lines_kept_off, print_json, whole_number
from anatomist.cli.recipe_flags import add_recipe_flags, recipe_file_from_args, recipe_from_args
from anatomist.cli.render import Column, console, print_table
from anatomist.workload_loader import load_workload

if TYPE_CHECKING:
    from anatomist.measure.profile import ProfileResult


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="profile real training steps: time and FLOPs by operation class")
    add_model_flags(p, data_flags=False)
    add_recipe_flags(p)
    p.add_argument("--steps", type=whole_number, default=3, metavar="N", help="profiled steps after one warm-up step (default 3)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout, nothing else")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    source = recipe_file_from_args(args)
    recipe = recipe_from_args(args, source=source)
    seq_len = source.seq_len if args.seq_len is None and source is not None else args.seq_len
    workload = load_workload(args.model, seq_len=seq_len, task=args.task,
                             trust_remote_code=args.trust_remote_code, allow_network=args.allow_network)
    from anatomist.measure.profile import profile_training  # torch.profiler: only when profiling

    with native_log_lines_kept_off(args.verbose):
        result = profile_training(workload, recipe, steps=args.steps)
    if args.json:
        print_json(result.to_dict())
    else:
        render(result)
    return 0


def render(r: ProfileResult) -> None:
    out = console()
    out.print(f"[bold]profile[/] on {r.device}: {r.steps} steps after 1 warm-up, {r.step_s * 1e3:,.1f} ms/step, "
              f"{r.flops_per_step / 1e9:,.2f} GFLOP/step ({r.hardware_flops_per_step / 1e9:,.2f} with recomputation), "
              f"{r.achieved_tflops:,.4f} TFLOP/s achieved"
              + (f", MFU {r.mfu:.1%}, HFU {r.hfu:.1%}" if r.mfu is not None and r.hfu is not None
                 else " (MFU, HFU: no GPU)"))
    print_table(out, "Operation classes",
                [Column(name="class"), Column(name="FLOPs", right=True), Column(name="time", right=True)],
                [[cls, f"{v['flops_pct']:.2f}%", f"{v['time_pct']:.1f}%"] for cls, v in r.classes.items()])
    p = r.phases
    ratio = p["backward_s"] / p["forward_s"] if p["forward_s"] > 0 else float("nan")
    out.print(f"phases: forward {p['forward_s'] * 1e3:,.1f} ms, backward {p['backward_s'] * 1e3:,.1f} ms "
              f"({ratio:.2f}x forward), optimizer {p['optimizer_s'] * 1e3:,.1f} ms")
    print_table(out, "Top operations (self time)",
                [Column(name="op", whole=True), Column(name="class"), Column(name="time", right=True)],
                [[op["name"], op["class"], f"{op['time_pct']:.1f}%"] for op in r.top_ops])
    if r.unknown_ops:
        out.print(f"unknown ops (counted as other): {', '.join(r.unknown_ops)}", markup=False)
    for note in r.notes:
        out.print(f"  - {note}", markup=False)
