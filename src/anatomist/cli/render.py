"""Rich rendering helpers shared by subcommands: formatting happens here, at the edge."""

from __future__ import annotations

import os

from rich.console import Console

from anatomist.anatomy import GIB


def gib(nbytes: int | float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader went away (`anatomist models | head -1`): not an error. rich's own handler exits 1;
        here the stream goes to /dev/null (nothing later fails to flush) and the command ends (exit 0)."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.file.fileno())
        os.close(devnull)
        raise BrokenPipeError


def devices(num_gpus: int, nodes: int = 1) -> str:
    """"8" on one node, "2 nodes x 8" across nodes (`num_gpus` counts every node's)."""
    return f"{nodes} nodes x {num_gpus // nodes}" if nodes > 1 else str(num_gpus)


def console(stderr: bool = False) -> Console:
    return _Console(stderr=stderr, highlight=False, soft_wrap=False)


def plain_rows(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart, nothing cut: what a table becomes when
    the output is not a terminal (a pipe, a file), where every name must stay whole."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *rows])
