"""Rich rendering helpers shared by subcommands: formatting happens here, at the edge."""

from __future__ import annotations

from rich.console import Console

from anatomist.anatomy import GIB


def gib(nbytes: int | float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, soft_wrap=False)
