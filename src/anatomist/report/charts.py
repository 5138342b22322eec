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


CHAR_IN = 0.068
"""Width of one character of the 8.5-pt labels, in inches (DejaVu Sans averages ~0.55 em): what the layout
reserves beside an axes for its labels, so a long label widens the figure rather than squashing the chart."""
LABEL_CHARS = 34
"""A bar's or a point's label is wrapped at this many characters."""
MAX_NAMED_POINTS = 12
"""A throughput chart names every point up to this many, else only the Pareto front's (the table names all)."""


def _wrapped(text: str, width: int = LABEL_CHARS) -> str:
    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False)) or text


def _label_width_in(labels: list[str]) -> float:
    """Inches the widest of `labels` (wrapped) takes."""
    return CHAR_IN * max((len(line) for t in labels for line in t.split("\n")), default=0)


def _column_height_in(labels: list[str], fontsize: float = 8) -> float:
    """Inches a column of `labels` (wrapped) takes, stacked as `_callouts` stacks them."""
    return sum(len(t.split("\n")) for t in labels) * 1.45 * fontsize / 72


def _title(fig: Figure, ax, title: str, sub: str | None, *, left_in: float = 0.0) -> None:  # type: ignore[no-untyped-def]
    """The chart's name in bold, and under it, smaller, what it is about (model, GPU...). The subtitle is
    wrapped to the width the axes is left with (`left_in`: what its labels take on its left), so it is
    never cut at the figure's edge."""
    fig.suptitle(title, fontweight="bold", x=0.02, ha="left")
    if sub:
        # ~13 characters of 8.5 pt text per inch
        chars = max(30, int((fig.get_figwidth() - left_in - 0.6) * 13))
        ax.set_title(textwrap.fill(sub, chars), loc="left", fontsize=8.5, color="#555", fontweight="normal")


def _callouts(ax, points: list[tuple[float, float]], labels: list[str], *, fontsize: float = 8) -> None:  # type: ignore[no-untyped-def]
    """Each point's label in a column right of the axes, at the point's height where it can be, moved up or down
    just enough that no two labels overlap, joined to its point by a thin line: labels of points close together
    never cover each other nor the points (the layout makes room for the column)."""
    if not points:
        return
    ax.figure.draw_without_rendering()  # the limits and the laid-out size, before the labels are placed
    to_axes = ax.transData + ax.transAxes.inverted()
    height_pt = ax.get_window_extent().height * 72 / ax.figure.dpi
    rows = [len(label.split("\n")) for label in labels]
    gap = [1.45 * fontsize * n / height_pt for n in rows]  # each label's height, in axes fractions
    order = sorted(range(len(points)), key=lambda i: to_axes.transform(points[i])[1])
    wanted = {i: float(to_axes.transform(points[i])[1]) for i in order}
    placed: dict[int, float] = {}
    below = None
    for i in order:  # upwards: each at least half of both heights above the one below
        y = wanted[i] if below is None else max(wanted[i], placed[below] + (gap[below] + gap[i]) / 2)
        placed[i], below = y, i
    above = None
    for i in reversed(order):  # then down from the top, where the column ran past it
        top = 1.0 - gap[i] / 2 if above is None else placed[above] - (gap[above] + gap[i]) / 2
        placed[i], above = min(placed[i], top), i
    for i in order:
        ax.annotate(labels[i], points[i], xytext=(1.03, placed[i]), textcoords="axes fraction", fontsize=fontsize,
                    va="center", ha="left", annotation_clip=False,
                    arrowprops={"arrowstyle": "-", "color": "#999", "linewidth": 0.6, "shrinkA": 0, "shrinkB": 3})


def _with_label_columns(fig: Figure, plots: int, plot_in: float, label_in: float) -> list:  # type: ignore[type-arg]
    """`plots` axes side by side, each followed by an empty column `label_in` inches wide where `_callouts` writes
    its labels: the layout keeps that room, so a label is never cut at the figure's edge nor drawn over the next
    plot."""
    grid = fig.subplots(1, 2 * plots, squeeze=False, width_ratios=[plot_in, max(label_in, 0.3) + 0.3] * plots)[0]
    for column in grid[1::2]:
        column.set_axis_off()
    return list(grid[0::2])


def plots(fig: Figure) -> list:  # type: ignore[type-arg]
    """The axes of `fig` that draw something (not the empty columns beside them that hold their labels)."""
    return [ax for ax in fig.axes if ax.axison]


def _limit_lines(ax, rows: list[RecipeResult]) -> None:  # type: ignore[no-untyped-def]
    """Each GPU's capacity (dashed) and, where the input says it, the usable limit that decides "fits": the
    capacity less the margin (dotted)."""
    for capacity, limit, names in _capacities(rows):
        ax.axvline(capacity / GIB, color="black", linestyle="--", linewidth=1.1, label=f"{names}: {capacity / GIB:.1f} GiB")
        if limit is not None and limit != capacity:
            ax.axvline(limit / GIB, color="#B3261E", linestyle=":", linewidth=1.4,
                 label=f"usable ({names} less the margin): {limit / GIB:.1f} GiB")


@_styled
def memory_anatomy(results: list[RecipeResult]) -> Figure | None:
    """Stacked horizontal bars, one per recipe: the seven categories in GiB, each GPU's capacity and the usable
    limit (capacity less the margin) as lines.

    Horizontal, so recipe names of any length stay readable (wrapped, the figure as wide as they need); the first
    recipe is on top.
    """
    rows = [r for r in results if r.ok and r.memory is not None]
    if not rows:
        return None
    mixed = len({r.memory_source for r in rows}) > 1
    name = distinguishing(rows)
    labels = [_wrapped(f"{name(r)} ({r.memory_source})" if mixed else name(r)) for r in rows]
    label_in = _label_width_in(labels)
    lines = sum(len(t.split("\n")) for t in labels)
    fig = _figure(width_in=7.0 + label_in, height_in=2.4 + 0.3 * lines + 0.2 * len(rows))
    ax = fig.add_subplot()
    ys = list(range(len(rows)))[::-1]
    lefts = [0.0] * len(rows)
    for category in MemoryCategory:
        widths = [(r.memory or {}).get(category.value, 0) / GIB for r in rows]
        ax.barh(ys, widths, left=lefts, height=0.62, color=CATEGORY_COLOURS[category],
                label=category.label, edgecolor="white", linewidth=0.5)
        lefts = [a + w for a, w in zip(lefts, widths, strict=True)]
    ranges = [_likely_range(r) for r in rows]
    legend = "likely range of a prediction (the published runs' errors)"
    for y, total, likely in zip(ys, lefts, ranges, strict=True):
        if likely is not None:
            ax.plot(likely, (y, y), color="black", linewidth=1.2, marker="|", markersize=9, label=legend)
            legend = "_nolegend_"
        ax.annotate(f"{total:.2f}", (max(total, likely[1] if likely else 0), y), textcoords="offset points",
                    xytext=(3, -3), fontsize=8)
    _limit_lines(ax, rows)
    right = max([*lefts, *(hi for _, hi in filter(None, ranges)), *(c / GIB for c, _, _ in _capacities(rows))])
    ax.set_xlim(0, right * 1.1)  # room for the totals written past the longest bar
    ax.set_yticks(ys, labels, fontsize=8.5)
    ax.set_xlabel("GiB on the device at the step's peak")
    _title(fig, ax, "Memory anatomy per recipe", subtitle(rows), left_in=label_in)
    ax.grid(axis="y", visible=False)
    fig.legend(loc="outside lower center", ncols=4, frameon=False, fontsize=8.5)
    return fig


def _likely_range(row: RecipeResult) -> tuple[float, float] | None:
    """The likely range in GiB of a predicted device total (the estimate's `memory.interval`), None for a
    measured one or an input without it."""
    interval = (row.memory or {}).get("interval") if row.memory_source == "predicted" else None
    if not isinstance(interval, dict) or not {"low", "high"} <= interval.keys():
        return None
    return interval["low"] / GIB, interval["high"] / GIB


def _capacities(rows: list[RecipeResult]) -> list[tuple[int, int | None, str]]:
    """Distinct (GPU capacity, usable limit) with the device names that have them ("V100-16GB, other")."""
    names: dict[tuple[int, int | None], list[str]] = {}
    for r in rows:
        if r.gpu_memory_bytes:
            group = names.setdefault((int(r.gpu_memory_bytes), r.limit_bytes), [])
            if (r.gpu_name or "GPU") not in group:
                group.append(r.gpu_name or "GPU")
    return [(cap, limit, ", ".join(n)) for (cap, limit), n in sorted(names.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))]


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
    """Samples/s against device memory, one point per recipe, the Pareto front joined by a line and each of its
    points named in a column beside the chart (never over another): every point where there are few, else the
    front's."""
    rows = [r for r in results if r.ok and peak_bytes(r.memory) is not None and r.samples_per_second]
    if not rows:
        return None
    points = [(peak_bytes(r.memory) / GIB, float(r.samples_per_second or 0)) for r in rows]  # type: ignore[operator]
    front = pareto_front(points)
    name = distinguishing(rows)
    named = range(len(rows)) if len(rows) <= MAX_NAMED_POINTS else front  # beyond that, the table names them
    labels = [_wrapped(name(rows[i])) for i in named]
    label_in = _label_width_in(labels)
    # tall enough that the column of labels fits beside the plot (title, axis and legend take ~1.9 in)
    fig = _figure(width_in=6.5 + label_in, height_in=max(4.6, _column_height_in(labels) + 2.1))
    (ax,) = _with_label_columns(fig, 1, 6.0, label_in)
    ax.scatter([p[0] for p in points], [p[1] for p in points], s=36, color="#0072B2", alpha=0.6, label="recipe")
    ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "-o", color="#D55E00",
            linewidth=1.5, markersize=7, label="Pareto front")
    _limit_lines(ax, rows)
    sources = {"measured" if r.measured_samples_per_second is not None else "predicted" for r in rows}
    ax.set_xlabel("device memory at the peak (GiB)")
    ax.set_ylabel(f"samples / s ({' and '.join(sorted(sources))})")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0, top=max(p[1] for p in points) * 1.12)
    _title(fig, ax, "Throughput vs peak memory", subtitle(rows))
    fig.legend(loc="outside lower center", ncols=2, frameon=False, fontsize=8.5)
    _callouts(ax, [points[i] for i in named], labels)
    return fig


@_styled
def predicted_vs_measured(results: list[RecipeResult]) -> Figure | None:
    """Parity plot: predicted vs measured device memory (and samples/s when both exist), ±5% band; each point
    named in a column beside its plot."""
    mem_rows = [r for r in results if None not in comparable_peaks(r.predicted_memory, r.measured_memory)]
    if not mem_rows:
        return None
    speed_rows = [r for r in mem_rows if r.measured_samples_per_second and r.predicted_samples_per_second]
    name = distinguishing(mem_rows)
    label_in = _label_width_in([_wrapped(name(r)) for r in mem_rows])
    plots = 2 if speed_rows else 1
    fig = _figure(width_in=plots * (3.7 + label_in),
                  height_in=max(4.4, _column_height_in([_wrapped(name(r)) for r in mem_rows]) + 2.1))
    axes = _with_label_columns(fig, plots, 3.4, label_in)
    # mem_rows have both peaks (filtered above)
    mem_pairs = [tuple(cast(int, b) / GIB for b in comparable_peaks(r.predicted_memory, r.measured_memory)) for r in mem_rows]
    _parity(axes[0], mem_pairs, [_wrapped(name(r)) for r in mem_rows], "peak memory (GiB)")  # type: ignore[arg-type]
    if speed_rows:
        pairs = [(float(r.predicted_samples_per_second or 0), float(r.measured_samples_per_second or 0)) for r in speed_rows]
        _parity(axes[1], pairs, [_wrapped(name(r)) for r in speed_rows], "samples / s")
    _title(fig, axes[0], "Predicted vs measured", subtitle(mem_rows))
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncols=2, frameon=False, fontsize=8.5)
    for ax, pairs_, labels_ in ((axes[0], mem_pairs, [_wrapped(name(r)) for r in mem_rows]),
                                *([(axes[1], pairs, [_wrapped(name(r)) for r in speed_rows])] if speed_rows else [])):
        _callouts(ax, pairs_, labels_)  # type: ignore[arg-type]
    return fig


def _parity(ax, pairs: list[tuple[float, float]], labels: list[str], what: str) -> None:  # type: ignore[no-untyped-def]
    hi = max(max(p) for p in pairs) * 1.1
    line = [0.0, hi]
    band = PARITY_BAND_PCT / 100
    ax.fill_between(line, [x * (1 - band) for x in line], [x * (1 + band) for x in line], color="#009E73",
                    alpha=0.15, label=f"±{PARITY_BAND_PCT:g}%")
    ax.plot(line, line, color="#009E73", linewidth=1.0, label="predicted = measured")
    ax.scatter([p[0] for p in pairs], [p[1] for p in pairs], color="#0072B2", s=36, zorder=3)
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_aspect("equal")
    ax.set_xlabel(f"predicted {what}")
    ax.set_ylabel(f"measured {what}")


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
