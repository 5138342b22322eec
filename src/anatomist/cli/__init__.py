"""The `anatomist` command: thin subcommands over the library.

Each subcommand lives in its own module with `register(subparsers)`, which adds its parser
and sets `handler` to a function `(args) -> int`. Errors the user can fix (InputError)
become one line on stderr and exit code 2; anything else is exit code 1.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from anatomist import __version__
from anatomist.errors import InputError

GC_THRESHOLDS = (50_000, 50, 1000)
"""The cyclic collector's thresholds while a command runs (Python's: 700, 10, 10). Importing torch and
transformers and holding traces makes millions of objects that live to the end, which the default
thresholds traverse again and again (a fifth of a warm plan's time). No trace depends on the
collector: every storage a step frees dies by reference count (a test compares traces with the
collector off)."""

SUBCOMMAND_MODULES = ("estimate", "plan", "bench", "calibrate", "profile", "report", "catalog", "serve")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse would print usage + exit 2; keep one line
        self.exit(2, f"anatomist: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="anatomist", description="Know before you train: GPU memory and time of HF training.")
    parser.add_argument("--version", action="version", version=f"anatomist {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"anatomist.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # offline unless a command asks (--allow-network)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    thresholds = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        return int(args.handler(args) or 0)
    except InputError as exc:
        print(f"anatomist: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("anatomist: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    finally:
        gc.set_threshold(*thresholds)


def run() -> NoReturn:
    """The `anatomist` process (console script, `python -m anatomist`): `main`, then an exit that skips
    the interpreter's teardown.

    Once torch and transformers are imported, Python takes 0.6-0.8 s after the last line of work to
    unload them module by module, a seventh of a whole estimate, for nothing the user sees. The exit
    handlers still run (atexit: child processes joined, logging flushed) and the output is flushed;
    where a thread other than the main one still runs, the normal exit waits for it instead.
    """
    code = main()
    if any(t.is_alive() and not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # the reader went away, or the stream is closed: nothing to keep
            pass
    os._exit(code)
