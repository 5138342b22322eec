"""Flags and output shared by subcommands (the recipe flags: recipe_flags.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN
from anatomist.errors import InputError
from anatomist.recipe import Recipe
from anatomist.recipe.packages import missing_packages

if TYPE_CHECKING:
    from anatomist.recipe.files import RecipeFile


INT_MAX = 2**31 - 1
"""The largest whole number a flag takes (a C int, what the libraries below count in): a batch of 10**20 is
said to be too large where it is given, not turned into an anatomy of exabytes."""


def whole_number(text: str) -> int:
    """argparse's `type` for a count: a whole number of at most INT_MAX (its lower bound is the field's own check,
    said by the library with the field's name).

    Raises:
        argparse.ArgumentTypeError: not a whole number, or above INT_MAX (argparse says it with the flag's name).
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value > INT_MAX:
        raise argparse.ArgumentTypeError(f"must be at most 2^31 - 1 = {INT_MAX:,}, got {text}")
    return value


def add_model_flags(parser: argparse.ArgumentParser, *, model_required: bool = True, data_flags: bool = True) -> None:
    """MODEL and what shapes its inputs; `data_flags`: the data's lengths too (what the prediction reads)."""
    if model_required:
        parser.add_argument("model", metavar="MODEL", help="catalog name, Hub id in the local cache, or path")
    parser.add_argument("--seq-len", type=whole_number, default=None, metavar="N", help="tokens per sample (default 512)")
    parser.add_argument("--task", default=None, choices=["sequence-classification", "causal-lm", "seq2seq-lm", "masked-lm"])
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code from the Hub")
    parser.add_argument("--allow-network", action="store_true", help="let transformers ask the Hub for the config")
    if not data_flags:
        return
    data = parser.add_argument_group("the data's lengths (padding-free training and packing; the cost of padding)")
    data.add_argument("--avg-seq-len", type=whole_number, default=None, metavar="N",
                      help="mean tokens per example (at most --seq-len, the maximum length)")
    data.add_argument("--lengths", default=None, metavar="FILE",
                      help="token count of every example: one integer per line, or a JSON list")
    data.add_argument("--prompt-len", type=whole_number, default=None, metavar="N",
                      help="DPO: tokens of each prompt, which the loss does not score (default 0: every token)")


def add_devices_flags(parser: argparse.ArgumentParser, gpus_help: str) -> None:
    """--gpus, and the machines they are spread over (--nodes, --network)."""
    from anatomist.estimate.time.network import default_network, networks

    parser.add_argument("--gpus", type=whole_number, default=None, metavar="N",
                        help=f"{gpus_help}; with --nodes, the GPUs of one node")
    parser.add_argument("--nodes", type=whole_number, default=None, metavar="N",
                        help="machines the GPUs are spread over (default: the --recipe file's num_machines, else 1)")
    parser.add_argument("--network", default=None, metavar="NAME",
                        help=f"the network between the nodes (default {default_network()}; known: {', '.join(networks())})")


def read_recipe_source(path: str | None) -> RecipeFile | None:
    """The recipe file at `path` (--recipe), read, or None; what it sets that anatomist does not model is said once
    on stderr."""
    if not path:
        return None
    from anatomist.recipe.files import read_recipe_file

    source = read_recipe_file(path)
    note = source.note()
    if note:
        warn(note)
    return source


def warn(message: str) -> None:
    """One line on stderr that does not stop the command."""
    print(f"anatomist: note: {message}", file=sys.stderr)


PIP_SPECS = {"cut_cross_entropy": "'cut-cross-entropy[transformers] @ "
                                  "git+https://github.com/axolotl-ai-cloud/ml-cross-entropy.git@5f0c7a7'"}
"""What to pip install for a module where its name on PyPI is another release: Cut Cross-Entropy as axolotl installs
it (the version trace/standins/cce.py follows; PyPI's cut-cross-entropy is Apple's older release)."""


def note_missing_packages(recipe: Recipe) -> None:
    """A prediction needs none of the recipe's packages: say once what the training machine will."""
    missing = missing_packages(recipe)
    if missing:
        specs = " ".join(PIP_SPECS.get(name, name) for name in missing)
        warn(f"training this recipe needs {', '.join(missing)}, not installed here "
             f"(pip install {specs} on the training machine); the prediction does not need it")


_json_stdout: list[Any] = []
"""The command's stdout while `stdout_for_json_only` lends it to the JSON alone."""


@contextlib.contextmanager
def stdout_for_json_only(json_only: bool) -> Iterator[None]:
    """With --json: anything else written to stdout while the command runs goes to stderr, so that stdout holds the
    JSON and nothing else (DeepSpeed's import warning, which its logger prints on stdout, came before the JSON of
    `profile --peft qlora --json`: bitsandbytes' loading imports accelerate, which imports DeepSpeed)."""
    if not json_only:
        yield
        return
    _json_stdout.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _json_stdout.pop()


def print_json(data: Any) -> None:
    out = _json_stdout[-1] if _json_stdout else sys.stdout
    json.dump(data, out, indent=2, sort_keys=False)
    out.write("\n")


def positive_int(name: str, value: int | None) -> int | None:
    if value is not None and value <= 0:
        raise InputError(f"{name} must be greater than 0, got {value}")
    return value


def add_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-cache", action="store_true",
                   help="neither read nor write the on-disk trace cache (env ANATOMIST_NO_CACHE=1 does the same)")


def apply_cache_flag(no_cache: bool) -> None:
    """Turn the disk trace cache off for this process when --no-cache was given."""
    if no_cache:
        from anatomist.trace.store.cache import set_disk_cache

        set_disk_cache(False)


def add_margin_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-margin", type=float, default=DEFAULT_MEMORY_MARGIN, metavar="FRACTION",
                   help=f"share of GPU memory kept free when deciding what fits (default {DEFAULT_MEMORY_MARGIN})")


def add_calibration_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="time-model factors measured on this GPU by `anatomist calibrate` (default: the user's "
                        "<cache>/calibration/<GPU>.toml if any, else the published calibration of the GPU's generation)")


NATIVE_LOG_LINE = re.compile(r"^[A-Z]*:?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)? +\d+:\d+ +\w+\.(cpp|cc|h):\d+\] ")
"""A line a C++ library logs straight onto the process's stderr (Kineto, torch.profiler's back end:
"USDT:2026-11-27 13:37:25 3193:3193 SyncActivityProfilerHandler.cpp:52] profiler_start")."""


@contextlib.contextmanager
def native_log_lines_kept_off(verbose: bool) -> Iterator[None]:
    """Within the block, lines C++ libraries write to file descriptor 2 (NATIVE_LOG_LINE) are dropped, the rest
    of stderr passed on when the block ends; with `verbose`, nothing is touched. Python's sys.stderr cannot catch
    them: they are written below it."""
    if verbose:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not NATIVE_LOG_LINE.match(line)]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


@contextlib.contextmanager
def tracing_progress() -> Iterator[None]:
    """A progress bar on stderr while step parts are traced side by side (`trace.store.pool`), on a terminal only."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from anatomist.cli.render import console
    from anatomist.trace.store import pool

    # Refreshed by each report, not by a thread of its own: the next pool forks this process.
    progress = Progress(TextColumn("tracing step parts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console(stderr=True), transient=True, auto_refresh=False)
    tasks: list[Any] = []

    def report(done: int, total: int) -> None:
        if not tasks:
            tasks.append(progress.add_task("", total=total))
            progress.start()
        progress.update(tasks[0], completed=done, total=total)
        progress.refresh()
        if done == total:
            progress.stop()
            progress.remove_task(tasks.pop())

    with pool.watch(report):
        try:
            yield
        finally:
            progress.stop()
