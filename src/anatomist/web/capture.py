"""What a job prints on stderr, kept for that job: the CLI's notes ("anatomist: note: ...") become the page's.

The library says its notes with `print(..., file=sys.stderr)`, as a command line wants. The server
runs jobs in a worker thread beside the event loop, so `sys.stderr` is swapped once, at start, for a
stream that sends each thread's writes to that thread's buffer while it has one open (`captured()`)
and to the real stderr otherwise. Nothing is redirected for other threads (contextlib's
redirect_stderr would catch every thread's output, the server's log lines included).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

NOTE_PREFIX = "anatomist: note: "
"""How cli.common.warn starts a line."""

_local = threading.local()


class _ThreadStderr:
    """sys.stderr for the whole process: this thread's buffer when it has one, else the real stream."""

    def __init__(self, real: TextIO) -> None:
        self.real = real

    def write(self, text: str) -> int:
        buffer: list[str] | None = getattr(_local, "buffer", None)
        if buffer is None:
            return self.real.write(text)
        buffer.append(text)
        return len(text)

    def flush(self) -> None:
        self.real.flush()

    def isatty(self) -> bool:
        return False  # a job's output is read by the page, never a terminal: no progress bars drawn into it

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, ...: the real stream's
        return getattr(self.real, name)


def install() -> None:
    """Swap sys.stderr for the per-thread stream (once; later calls do nothing)."""
    if not isinstance(sys.stderr, _ThreadStderr):
        sys.stderr = _ThreadStderr(sys.stderr)  # type: ignore[assignment]


@contextlib.contextmanager
def captured() -> Iterator[list[str]]:
    """Within the block, what this thread writes to sys.stderr goes into the list yielded (as written)."""
    install()
    outer = getattr(_local, "buffer", None)
    buffer: list[str] = []
    _local.buffer = buffer
    try:
        yield buffer
    finally:
        _local.buffer = outer


def notes(written: list[str]) -> tuple[list[str], list[str]]:
    """(the CLI's notes without their prefix, every other non-empty line) of what `captured` collected."""
    lines = [line for line in "".join(written).splitlines() if line.strip()]
    return ([line.removeprefix(NOTE_PREFIX) for line in lines if line.startswith(NOTE_PREFIX)],
            [line for line in lines if not line.startswith(NOTE_PREFIX)])
