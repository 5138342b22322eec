"""Print a RunSummary as the seeds' `print_summary` does, with the memory by category."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from anatomist.anatomy import MIB, TENSOR_CATEGORIES
from anatomist.measure.recorder import RunSummary


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:,.1f} MiB"


def summary_table(summary: RunSummary) -> Table:
    """One table: time and throughput, then the attributed step's memory by category."""
    table = Table(title="anatomist: run summary", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("time", f"{summary.train_runtime_s:.2f} s ({summary.steps} optimizer steps)")
    if summary.samples_per_second is not None:
        table.add_row("samples/s", f"{summary.samples_per_second:.2f} (median step {summary.median_step_s:.4f} s)")
    if summary.tokens_per_second is not None:
        table.add_row("tokens/s", f"{summary.tokens_per_second:,.0f}")
    if summary.mfu is not None:
        table.add_row("MFU", f"{summary.mfu:.1%}")
    if summary.hfu is not None:
        table.add_row("HFU (with recomputation)", f"{summary.hfu:.1%}")
    memory = summary.memory
    if memory is not None:
        table.add_row(f"peak allocated ({memory.peak_phase})", _mib(memory.peak_allocated))
        for category in TENSOR_CATEGORIES:
            table.add_row(f"  {category.label}", _mib(memory.category_bytes(category)))
        if memory.peak_reserved is not None:
            table.add_row("peak reserved", _mib(memory.peak_reserved))
    device = summary.device
    if device["source"] == "nvml":
        table.add_row(f"device memory used ({device['name']}, NVML)", _mib(device["used_bytes"]))
    else:
        table.add_row("process peak resident memory (no GPU: CPU figure)", _mib(device["peak_bytes"]))
    if summary.cuda_context_bytes is not None:
        table.add_row("CUDA context", _mib(summary.cuda_context_bytes))
    return table


def print_summary(summary: RunSummary, console: Console | None = None) -> None:
    (console or Console(stderr=True, highlight=False)).print(summary_table(summary))
