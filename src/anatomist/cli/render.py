"""Rich rendering helpers shared by subcommands: formatting happens here, at the edge.

Output is read in two places: a terminal, where rich draws tables with boxes at the terminal's width, and
a pipe or a file (`| cat`, `> log`, a CI log), where nothing may be cut or hard-wrapped: a table becomes
plain columns as wide as their widest cell, and a long line stays one line (`console()` soft-wraps there).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

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
    """The command's console: on a terminal, lines wrap at its width; elsewhere (a pipe, a file) a line is
    never wrapped, so a log keeps each sentence whole and a `grep` finds it."""
    out = _Console(stderr=stderr, highlight=False, soft_wrap=False)
    if not out.is_terminal:
        out.soft_wrap = True
    return out


def plain_rows(header: list[str], rows: list[list[str]], right: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell, two spaces apart, nothing cut: what a table becomes when
    the output is not a terminal (a pipe, a file), where every name must stay whole. `right`: the
    columns (by index) aligned right, numbers."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                     for r in [header, *rows])


@dataclass(kw_only=True, slots=True, frozen=True)
class Column:
    """One column of a `print_table` table."""

    name: str
    right: bool = False
    """Right-aligned: numbers."""
    whole: bool = False
    """A name one types (a GPU, a model, a row): never narrowed on a terminal; the other columns give way."""


def print_table(out: Console, title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]], *,
                marked: Sequence[int] = (), mark: str = "*", caption: str | None = None, total: bool = False) -> None:
    """A table on `out`: boxed at the terminal's width, or plain columns where `out` is not a terminal.

    Cells are plain text (no rich markup: a name like `[bold]` is printed as it is). `marked`: rows shown in bold
    green on a terminal and behind `mark` in plain columns (the plan's top pick, the chosen cluster size). `total`:
    the last row is a total, set apart by a rule on a terminal."""
    chosen = set(marked)
    if not out.is_terminal:
        header = [c.name for c in columns]
        cells = [list(r) for r in rows]
        right = [i for i, c in enumerate(columns) if c.right]
        if chosen:
            header, cells = ["", *header], [[mark if i in chosen else "", *r] for i, r in enumerate(cells)]
            right = [i + 1 for i in right]
        lines = [title, plain_rows(header, cells, right)] + ([caption] if caption else [])
        out.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)
        return
    table = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        widest = max((len(r[i]) for r in rows), default=0)
        table.add_column(c.name, justify="right" if c.right else "left", overflow="fold",
                         no_wrap=c.whole, min_width=max(widest, len(c.name)) if c.whole else None)
    for i, row in enumerate(rows):
        if total and i == len(rows) - 1:
            table.add_section()
        table.add_row(*(Text(cell) for cell in row), style="bold" if total and i == len(rows) - 1
                      else "bold green" if i in chosen else None)
    out.print(table)
    if caption:  # under the table, wrapped at the terminal's width, not the table's
        out.print(caption, markup=False, highlight=False)
