"""The `anatomist` command: thin subcommands over the library.

Each subcommand lives in its own module with `register(subparsers)`, which adds its parser
and sets `handler` to a function `(args) -> int`. Errors the user can fix (InputError)
become one line on stderr and exit code 2; anything else is exit code 1.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import NoReturn

from anatomist import __version__
from anatomist.errors import InputError

GC_THRESHOLDS = (50_000, 50, 1000)
"""The cyclic collector's thresholds while a command runs (Python's: 700, 10, 10). Importing torch and
transformers and holding traces makes millions of objects that live to the end, which the default
thresholds traverse again and again (a fifth of a warm plan's time). No trace depends on the
collector: every storage a step frees dies by reference count (a test compares traces with the
collector off)."""

COMMAND_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
"""Set for the command where the user has not set them: offline unless a command asks
(--allow-network), and transformers' own warnings quiet (anatomist says what matters)."""
QUIET_LOGGERS = ("torch.utils._pytree", "torchao", "bitsandbytes")
"""Loggers whose warnings say nothing to a user of anatomist and are kept below ERROR while a command
runs: torchao registering enums with torch's pytree when transformers' quantizers import it,
torchao's "Failed to load" of its CUDA extensions on a machine without them, and bitsandbytes' "Failed
to load CPU gemm_4bit_forward from kernels-community" when a traced 8-bit optimizer or QLoRA imports it
on a CPU with AVX-512 BF16 (the kernel runs no step here)."""
NORMAL_EXIT_VARIABLE = "ANATOMIST_NORMAL_EXIT"
"""Set to 1 to end the process with the interpreter's normal teardown (see `run`)."""

SUBCOMMAND_MODULES = ("estimate", "plan", "check", "bench", "calibrate", "profile", "report", "catalog", "serve")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse would print usage + exit 2; keep one line
        self.exit(2, f"anatomist: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="anatomist", description="Know before you train: GPU memory and time of HF training.")
    parser.add_argument("--version", action="version", version=f"anatomist {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"anatomist.cli.{name}").register(sub)
    for command in sub.choices.values():
        command.add_argument("--verbose", action="store_true",
                             help="also show what the libraries anatomist runs say (their warnings, the profiler's "
                                  "own lines), kept off the screen otherwise")
    return parser


@contextlib.contextmanager
def command_settings(*, allow_network: bool = False, verbose: bool = False) -> Iterator[None]:
    """The process-wide settings of one command (COMMAND_ENVIRONMENT, QUIET_LOGGERS, GC_THRESHOLDS, other
    packages' Python warnings ignored), undone when it ends: `main` called in a process that does more (a test, a
    server) leaves it as it was. With `allow_network` (--allow-network) the Hub may be asked: HF_HUB_OFFLINE is
    unset for the command. With `verbose` (--verbose) the libraries' warnings and loggers are left as they are."""
    saved_env = {name: os.environ.get(name) for name in COMMAND_ENVIRONMENT}
    for name, setting in COMMAND_ENVIRONMENT.items():
        if not (verbose and name == "TRANSFORMERS_VERBOSITY"):
            os.environ.setdefault(name, setting)
    if allow_network:
        os.environ.pop("HF_HUB_OFFLINE", None)
    loggers = [] if verbose else [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    thresholds = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    caught = warnings.catch_warnings()
    caught.__enter__()
    if not verbose:  # transformers' FutureWarnings of the TrainingArguments a profile builds, torch's UserWarnings...
        warnings.filterwarnings("ignore")
        warnings.filterwarnings("default", module=r"anatomist(\.|$)")  # anatomist's own are meant for the user
    try:
        yield
    finally:
        caught.__exit__(None, None, None)
        gc.set_threshold(*thresholds)
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        for name, saved in saved_env.items():
            if saved is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = saved


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    from anatomist.cli.common import stdout_for_json_only  # the subcommand's module imported it already

    with command_settings(allow_network=bool(getattr(args, "allow_network", False)),
                          verbose=bool(getattr(args, "verbose", False))), \
            stdout_for_json_only(bool(getattr(args, "json", False))):
        try:
            return int(args.handler(args) or 0)
        except InputError as exc:
            print(f"anatomist: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("anatomist: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
            return 0


def run() -> NoReturn:
    """The `anatomist` process (console script, `python -m anatomist`): `main`, then an exit that skips
    the interpreter's teardown.

    Once torch and transformers are imported, Python takes 0.6-0.8 s after the last line of work to
    unload them module by module, a seventh of a whole estimate, for nothing the user sees. The exit
    handlers still run (atexit: child processes joined, logging flushed) and the output is flushed.
    The normal exit is taken instead where a thread other than the main one still runs, where the
    interpreter has no `atexit._run_exitfuncs` (it is CPython's), and where ANATOMIST_NORMAL_EXIT=1.
    """
    code = main()
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)  # CPython's; where missing, the normal exit
    if (run_exit_handlers is None or os.environ.get(NORMAL_EXIT_VARIABLE, "") not in ("", "0")
            or any(t.is_alive() and not t.daemon and t is not threading.main_thread() for t in threading.enumerate())):
        sys.exit(code)
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # the reader went away, or the stream is closed: nothing to keep
            pass
    os._exit(code)
