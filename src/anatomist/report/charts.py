"""The report's charts, drawn with matplotlib (Agg backend, no display needed).

Each chart is a function that takes `ReportData` pieces and returns a `Figure`, or None when
the input holds nothing to draw (the HTML then says why instead of showing an empty frame).
Memory categories are always stacked in `MemoryCategory` order with the same colours, so a
reader learns the colours once (Okabe & Ito's colour-blind-safe palette,
https://jfly.uni-koeln.de/color/).
"""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, no display

from matplotlib.figure import Figure  # noqa: E402

from anatomist.anatomy import GIB, MemoryCategory, OpClass  # noqa: E402
from anatomist.report.about import distinguishing, subtitle  # noqa: E402
from anatomist.report.load import RecipeResult, comparable_peaks, peak_bytes  # noqa: E402

PARITY_BAND_PCT = 5.0
"""DESIGN.md's quality bar: predicted memory within 5% of the measured peak."""

CATEGORY_COLOURS: dict[MemoryCategory, str] = {
    MemoryCategory.WEIGHTS: "#0072B2",
    MemoryCategory.OPTIMIZER_STATES: "#E69F00",
    MemoryCategory.GRADIENTS: "#009E73",
    MemoryCategory.ACTIVATIONS: "#D55E00",
    MemoryCategory.TEMPORARY: "#CC79A7",
    MemoryCategory.FUNCTIONALITY: "#56B4E9",
    MemoryCategory.RUNTIME_OVERHEAD: "#999999",
}
P = ParamSpec("P")
R = TypeVar("R")
OP_CLASS_ORDER: tuple[str, ...] = tuple(c.value for c in OpClass)

_STYLE: Any = {  # Any: matplotlib types rcParams keys as a Literal of every name
    "font.size": 10,
    "axes.titlesize": 12,
    "axes.titleweight": "bold",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
}


def _styled(chart: Callable[P, R]) -> Callable[P, R]:
    """Draw `chart` under the report's style without touching the caller's global rcParams."""

    @functools.wraps(chart)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with matplotlib.rc_context(_STYLE):
            return chart(*args, **kwargs)

    return wrapper


def _figure(width_in: float = 8.0, height_in: float = 4.2) -> Figure:
    # Figure() directly, not pyplot: no global figure registry, nothing to close or leak.
    return Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")


def _title(fig: Figure, ax, title: str, sub: str | None) -> None:  # type: ignore[no-untyped-def]
    """The chart's name in bold, and under it, smaller, what it is about (model, GPU...)."""
    fig.suptitle(title, fontweight="bold", x=0.02, ha="left")
    if sub:
        # ~13 characters of 8.5 pt text per inch of figure: wrap rather than run off a narrow chart
        ax.set_title(textwrap.fill(sub, int(fig.get_figwidth() * 13)), loc="left", fontsize=8.5, color="#555",
                     fontweight="normal")


@_styled
def memory_anatomy(results: list[RecipeResult]) -> Figure | None:
    """Stacked horizontal bars, one per recipe: the seven categories in GiB, GPU capacity as a line.

    Horizontal, so recipe names of any length stay readable; the first recipe is on top.
    """
    rows = [r for r in results if r.ok and r.memory is not None]
    if not rows:
        return None
    fig = _figure(width_in=9.0, height_in=2.2 + 0.42 * len(rows))
    ax = fig.add_subplot()
    ys = list(range(len(rows)))[::-1]
    lefts = [0.0] * len(rows)
    for category in MemoryCategory:
        widths = [(r.memory or {}).get(category.value, 0) / GIB for r in rows]
        ax.barh(ys, widths, left=lefts, height=0.62, color=CATEGORY_COLOURS[category],
                label=category.label, edgecolor="white", linewidth=0.5)
        lefts = [a + w for a, w in zip(lefts, widths, strict=True)]
    for y, total in zip(ys, lefts, strict=True):
        ax.annotate(f"{total:.2f}", (total, y), textcoords="offset points", xytext=(3, -3), fontsize=8)
    for i, (capacity, names) in enumerate(_capacities(rows)):
        ax.axvline(capacity / GIB, color="black", linestyle=("--", ":", "-.")[i % 3], linewidth=1.2,
                   label=f"{names}: {capacity / GIB:.1f} GiB")
    mixed = len({r.memory_source for r in rows}) > 1
    label = distinguishing(rows)
    ax.set_yticks(ys, [f"{label(r)} ({r.memory_source})" if mixed else label(r) for r in rows])
    ax.set_xlabel("GiB on the device at the step's peak")
    _title(fig, ax, "Memory anatomy per recipe", subtitle(rows))
    ax.grid(axis="y", visible=False)
    fig.legend(loc="outside lower center", ncols=4, frameon=False, fontsize=8.5)
    return fig


def _capacities(rows: list[RecipeResult]) -> list[tuple[int, str]]:
    """Distinct GPU capacities with the device names that have them ("V100-16GB, other")."""
    names: dict[int, list[str]] = {}
    for r in rows:
        if r.gpu_memory_bytes:
            group = names.setdefault(int(r.gpu_memory_bytes), [])
            if (r.gpu_name or "GPU") not in group:
                group.append(r.gpu_name or "GPU")
    return [(cap, ", ".join(n)) for cap, n in sorted(names.items())]


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats: less or equal memory and more or equal speed.

    `points` are (memory, throughput). Returned in order of increasing memory.
    Example: [(1, 10), (2, 5), (3, 20)] -> [0, 2]: (2, 5) needs more memory than (1, 10) for less.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front: list[int] = []
    best = float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


@_styled
def throughput_vs_memory(results: list[RecipeResult]) -> Figure | None:
    """Samples/s against device memory, one point per recipe, the Pareto front joined by a line."""
    rows = [r for r in results if r.ok and peak_bytes(r.memory) is not None and r.samples_per_second]
    if not rows:
        return None
    points = [(peak_bytes(r.memory) / GIB, float(r.samples_per_second or 0)) for r in rows]  # type: ignore[operator]
    front = pareto_front(points)
    fig = _figure()
    ax = fig.add_subplot()
    ax.scatter([p[0] for p in points], [p[1] for p in points], s=36, color="#0072B2", alpha=0.6, label="recipe")
    ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "-o", color="#D55E00",
            linewidth=1.5, markersize=7, label="Pareto front")
    label = distinguishing(rows)
    for i in front:
        ax.annotate(label(rows[i]), points[i], textcoords="offset points", xytext=(6, 4), fontsize=8)
    for capacity, names in _capacities(rows):
        ax.axvline(capacity / GIB, color="black", linestyle="--", linewidth=1.0, label=f"{names}: {capacity / GIB:.1f} GiB")
    sources = {"measured" if r.measured_samples_per_second is not None else "predicted" for r in rows}
    ax.set_xlabel("device memory at the peak (GiB)")
    ax.set_ylabel(f"samples / s ({' and '.join(sorted(sources))})")
    _title(fig, ax, "Throughput vs peak memory", subtitle(rows))
    ax.legend(frameon=False, fontsize=8.5, loc="best")
    return fig


@_styled
def predicted_vs_measured(results: list[RecipeResult]) -> Figure | None:
    """Parity plot: predicted vs measured device memory (and samples/s when both exist), ±5% band."""
    mem_rows = [r for r in results if None not in comparable_peaks(r.predicted_memory, r.measured_memory)]
    if not mem_rows:
        return None
    speed_rows = [r for r in mem_rows if r.measured_samples_per_second and r.predicted_samples_per_second]
    fig = _figure(width_in=8.0 if speed_rows else 5.0, height_in=4.2)
    axes = fig.subplots(1, 2 if speed_rows else 1, squeeze=False)[0]
    # mem_rows have both peaks (filtered above)
    mem_pairs = [tuple(cast(int, b) / GIB for b in comparable_peaks(r.predicted_memory, r.measured_memory)) for r in mem_rows]
    label = distinguishing(mem_rows)
    _parity(axes[0], mem_pairs, [label(r) for r in mem_rows], "peak memory (GiB)")  # type: ignore[arg-type]
    if speed_rows:
        pairs = [(float(r.predicted_samples_per_second or 0), float(r.measured_samples_per_second or 0)) for r in speed_rows]
        _parity(axes[1], pairs, [label(r) for r in speed_rows], "samples / s")
    _title(fig, axes[0], "Predicted vs measured", subtitle(mem_rows))
    return fig


def _parity(ax, pairs: list[tuple[float, float]], labels: list[str], what: str) -> None:  # type: ignore[no-untyped-def]
    hi = max(max(p) for p in pairs) * 1.1
    line = [0.0, hi]
    band = PARITY_BAND_PCT / 100
    ax.fill_between(line, [x * (1 - band) for x in line], [x * (1 + band) for x in line], color="#009E73",
                    alpha=0.15, label=f"±{PARITY_BAND_PCT:g}%")
    ax.plot(line, line, color="#009E73", linewidth=1.0, label="predicted = measured")
    ax.scatter([p[0] for p in pairs], [p[1] for p in pairs], color="#0072B2", s=36, zorder=3)
    if len(pairs) <= 8:
        for (x, y), label in zip(pairs, labels, strict=True):
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_aspect("equal")
    ax.set_xlabel(f"predicted {what}")
    ax.set_ylabel(f"measured {what}")
    ax.legend(frameon=False, fontsize=8, loc="lower right")


@_styled
def op_class_shares(classes: dict[str, dict[str, float]] | None, device: str | None = None) -> Figure | None:
    """Side-by-side bars: each operation class's share of the FLOPs and of the time (percent)."""
    if not classes:
        return None
    names = [c for c in OP_CLASS_ORDER if c in classes] + sorted(c for c in classes if c not in OP_CLASS_ORDER)
    fig = _figure(width_in=7.0, height_in=4.0)
    ax = fig.add_subplot()
    xs = list(range(len(names)))
    width = 0.38
    flops = [classes[n]["flops_pct"] for n in names]
    time = [classes[n]["time_pct"] for n in names]
    bars_f = ax.bar([x - width / 2 for x in xs], flops, width, color="#0072B2", label="share of FLOPs")
    bars_t = ax.bar([x + width / 2 for x in xs], time, width, color="#E69F00", label="share of time")
    ax.bar_label(bars_f, fmt="{:.3g}%", fontsize=8)  # 3 significant digits: 0.17% stays visible
    ax.bar_label(bars_t, fmt="{:.3g}%", fontsize=8)
    ax.set_xticks(xs, names)
    ax.set_ylabel("percent of the step")
    ax.set_ylim(0, max([*flops, *time, 1.0]) * 1.15)
    _title(fig, ax, "Operation classes: FLOPs vs time", device)
    ax.grid(axis="x", visible=False)
    ax.legend(frameon=False)
    return fig
