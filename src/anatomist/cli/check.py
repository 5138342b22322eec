"""`anatomist check MODEL --recipe FILE`: will it fit? An exit code for CI and job schedulers.

Exit 0: the recipe fits, or is borderline (the limit inside its memory interval: stderr says so and what would fit
even at the top of the interval); the pre-flight table on stdout. Exit 3: it does not fit, even at the bottom of its
interval; stderr says the prediction, the limit and the smallest change that fits (`anatomist.measure.preflight`,
"refuse"'s search: the batch/accumulation pairs that keep the effective batch, then checkpointing and the
optimizer). Exit 2: bad input, one line.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from anatomist.cli.common import (
    add_cache_flag,
    add_devices_flags,
    add_margin_flag,
    add_model_flags,
    print_json,
    tracing_progress,
)
from anatomist.cli.recipe_flags import add_recipe_flags
from anatomist.errors import InputError

if TYPE_CHECKING:
    from anatomist.cli.requests import CheckRequest
    from anatomist.measure.preflight import Preflight

NOT_FITTING_EXIT = 3
"""The exit code of a recipe that will not fit (2 is bad input, as for every command)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="exit 0 if the recipe fits the GPU, 3 if not (with the smallest change that fits)")
    add_model_flags(p)
    add_recipe_flags(p)
    p.add_argument("--gpu", default="local", metavar="NAME", help="target GPU (default: the one NVML finds here)")
    add_devices_flags(p, "data-parallel devices (default: the --recipe file's, else 1)")
    p.add_argument("--limit-gib", type=float, default=None, metavar="GIB",
                   help="an explicit memory budget per device in GiB (2**30 bytes), instead of the GPU's memory less "
                        "the margin")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout, nothing else")
    add_margin_flag(p)
    add_cache_flag(p)
    p.set_defaults(handler=run, mode="train")


def run(args: argparse.Namespace) -> int:
    from anatomist.cli.requests import check_request

    result = build_check(check_request(args))
    if args.json:
        print_json(result.to_dict())
    else:
        print(result.table())
    if not result.fits:
        print(result.refusal(), file=sys.stderr)
    return NOT_FITTING_EXIT if result.refused else 0


def build_check(request: CheckRequest) -> Preflight:
    """The pre-flight `request` asks for: "refuse"'s verdict and, where it does not fit, the smallest change that does."""
    from anatomist.cli.estimate import estimate_inputs
    from anatomist.measure.preflight import preflight, target_gpu

    if request.limit_gib is not None and request.limit_gib <= 0:
        raise InputError(f"--limit-gib must be greater than 0, got {request.limit_gib}")
    limit = int(request.limit_gib * 2**30) if request.limit_gib is not None else None
    asked = request.estimate
    gpu, margin = target_gpu(None if asked.gpu in ("local", "auto") else asked.gpu, limit, asked.memory_margin)
    with tracing_progress():
        workload, recipe, gpu, (num_gpus, _) = estimate_inputs(asked, gpu)  # whether it fits: the same on any node
        return preflight(workload, recipe, gpu, num_gpus=num_gpus, margin=margin, mode="refuse", budget_bytes=limit)
