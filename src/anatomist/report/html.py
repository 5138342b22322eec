"""One self-contained HTML page: notices, each chart as an embedded PNG, the table behind it.

Self-contained means it opens offline and can be mailed: no external script, style sheet or
font; images are `data:` URIs. Every table cell that holds a number carries `data-key` and
`data-value` (the raw number from the input, bytes for memory) so a test, or a reader's own
script, can check the page against the results file without parsing formatted text.
"""

from __future__ import annotations

import base64
import datetime as _dt
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any, cast

from anatomist import __version__
from anatomist.anatomy import GIB, MemoryCategory
from anatomist.report.about import describe, distinguishing
from anatomist.report.charts import OP_CLASS_ORDER, pareto_front
from anatomist.report.load import RecipeResult, ReportData, comparable_peaks, peak_bytes


@dataclass(kw_only=True, slots=True)
class Chart:
    """One rendered chart (PNG bytes) or the reason it could not be drawn."""

    key: str
    """Stable id: memory, throughput, parity, classes (also the --png file name)."""
    title: str
    png: bytes | None
    missing_reason: str = ""


_CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}
h1{margin-bottom:.2em}h2{margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.meta{color:#666;font-size:.9em}
.about{display:grid;grid-template-columns:max-content 1fr;gap:.15em 1em;margin:.8em 0}
.about dt{font-weight:600}.about dd{margin:0}
.notices{background:#fff4e5;border-left:4px solid #E69F00;padding:.6em 1em;margin:1em 0}
.notices p{margin:.3em 0}
img.chart{max-width:100%;height:auto;display:block;margin:.5em 0}
.missing{color:#666;font-style:italic}
table{border-collapse:collapse;font-size:.8em;margin:.5em 0 1em;max-width:100%}
th,td{border:1px solid #ddd;padding:.25em .5em}th{background:#f4f4f4;font-weight:600;vertical-align:bottom}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.failed td{color:#a33}
details summary{cursor:pointer;color:#0072B2}
.scroll{overflow-x:auto}
section{margin-top:1.5em}
.sr{position:absolute;width:1px;height:1px;overflow:hidden;clip:rect(0 0 0 0)}
"""


def render_html(data: ReportData, charts: list[Chart]) -> str:
    """The whole page as one string."""
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>anatomist report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>anatomist report</h1>",
        f'<p class="meta">From {", ".join(_source(s) for s in data.sources) or "(nothing)"} '
        f"({escape(', '.join(data.kinds))}); anatomist {escape(__version__)}, {now}. "
        "Memory in GiB (2<sup>30</sup> bytes).</p>",
        _about(data),
    ]
    if data.notices:
        parts.append('<div class="notices" id="notices">')
        parts += [f'<p class="notice">{escape(n)}</p>' for n in data.notices]
        parts.append("</div>")
    tables = {
        "memory": _memory_table(data.ok_results),
        "throughput": _throughput_table(data.ok_results),
        "parity": _parity_table(data.results),
        "classes": _classes_table(data),
    }
    for chart in charts:
        # the chart carries its own title; the heading is for outline and screen readers only
        parts.append(f'<section id="section-{chart.key}"><h2 class="sr">{escape(chart.title)}</h2>')
        if chart.png:
            b64 = base64.b64encode(chart.png).decode("ascii")
            parts.append(f'<img class="chart" id="chart-{chart.key}" data-chart="{chart.key}" '
                         f'alt="{escape(chart.title)}" src="data:image/png;base64,{b64}">')
            parts.append(tables.get(chart.key, ""))
        else:
            parts.append(f'<h3>{escape(chart.title)}</h3>')
            parts.append(f'<p class="missing" data-chart="{chart.key}">{escape(chart.missing_reason)}</p>')
        parts.append("</section>")
    if data.failed_results:
        parts.append('<section id="section-failed"><h2>Runs that did not finish</h2>')
        parts.append(_failed_table(data.failed_results))
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _about(data: ReportData) -> str:
    """The header: model, parameters, sequence length, batch, recipe and GPU of the inputs."""
    rows = "".join(f'<dt>{escape(f.label)}</dt><dd data-key="{f.key}">{escape(f.text)}</dd>' for f in describe(data))
    return f'<dl class="about" id="about">{rows}</dl>'


def _num(key: str, value: Any, text: str) -> str:
    return f'<td class="num" data-key="{escape(key)}" data-value="{escape(str(value))}">{escape(text)}</td>'


def _gib(nbytes: int | float | None) -> str:
    return "" if nbytes is None else f"{nbytes / GIB:.2f}"


def _table(table_id: str, header: list[str], rows: list[str]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    return (f'<details open><summary>table</summary><div class="scroll"><table id="{table_id}"><thead><tr>{head}'
            f"</tr></thead><tbody>{''.join(rows)}</tbody></table></div></details>")


def _source(path: str) -> str:
    """The file name, with the full path as a tooltip: the page stays readable and shareable."""
    return f'<span title="{escape(path)}">{escape(Path(path).name)}</span>'



def _memory_table(results: list[RecipeResult]) -> str:
    """The memory chart's numbers; the columns every row shares a value in (model, GPU, source) are left out: the
    header above says them, and the table fits the page's width."""
    name = distinguishing(results)
    keys = [c.value for c in MemoryCategory] + ["peak_allocated", "peak_reserved", "device_total"]
    described = [("model", lambda r: r.model), ("GPU", lambda r: r.gpu_name or ""), ("source", lambda r: r.memory_source)]
    shown = [(h, get) for h, get in described if len({get(r) for r in results}) > 1]
    header = ["recipe", *[h for h, _ in shown], *[c.label for c in MemoryCategory],
              "peak allocated", "peak reserved", "device total", "peak phase", "usable (GPU less margin)", "GPU capacity"]
    rows = []
    for i, r in enumerate(results):
        mem = r.memory or {}
        cells = [f"<td>{escape(name(r))}</td>"] + [f"<td>{escape(get(r))}</td>" for _, get in shown]
        cells += [_num(k, mem.get(k), _gib(mem.get(k))) for k in keys]
        cells.append(f"<td>{escape(str(mem.get('peak_phase', '')))}</td>")
        cells.append(_num("limit_bytes", r.limit_bytes, _gib(r.limit_bytes)))
        cells.append(_num("gpu_memory_bytes", r.gpu_memory_bytes, _gib(r.gpu_memory_bytes)))
        rows.append(f'<tr data-row="{i}" data-label="{escape(name(r))}">{"".join(cells)}</tr>')
    return _table("table-memory", header, rows)


def _throughput_table(results: list[RecipeResult]) -> str:
    rows_in = [r for r in results if r.samples_per_second and peak_bytes(r.memory) is not None]
    front = set(pareto_front([(cast(int, peak_bytes(r.memory)), float(r.samples_per_second or 0)) for r in rows_in]))  # rows_in have one
    rows = []
    name = distinguishing(rows_in)
    for i, r in enumerate(rows_in):
        peak = peak_bytes(r.memory)
        sps = r.samples_per_second
        rows.append(
            f'<tr data-row="{i}" data-label="{escape(name(r))}"><td>{escape(name(r))}</td>'
            + _num("device_total", peak, _gib(peak))
            + _num("samples_per_second", sps, f"{sps:.2f}")
            + f"<td>{'yes' if i in front else ''}</td></tr>"
        )
    return _table("table-throughput", ["recipe", "device total (GiB; CPU runs: peak allocated)", "samples / s", "Pareto front"], rows)


def _pct_error(predicted: float | None, measured: float | None) -> str:
    if not predicted or not measured:
        return ""
    return f"{(predicted - measured) / measured * 100:+.1f}%"


def _parity_table(results: list[RecipeResult]) -> str:
    rows = []
    compared = [x for x in results if None not in comparable_peaks(x.predicted_memory, x.measured_memory)]
    name = distinguishing(compared)
    for i, r in enumerate(compared):
        p, m = comparable_peaks(r.predicted_memory, r.measured_memory)
        ps, ms = r.predicted_samples_per_second, r.measured_samples_per_second
        rows.append(
            f'<tr data-row="{i}" data-label="{escape(name(r))}"><td>{escape(name(r))}</td>'
            + _num("predicted_device_total", p, _gib(p)) + _num("measured_device_total", m, _gib(m))
            + f'<td class="num">{_pct_error(p, m)}</td>'
            + _num("predicted_samples_per_second", ps, "" if ps is None else f"{ps:.2f}")
            + _num("measured_samples_per_second", ms, "" if ms is None else f"{ms:.2f}")
            + f'<td class="num">{_pct_error(ps, ms)}</td></tr>'
        )
    header = ["recipe", "predicted peak (GiB)", "measured peak (GiB)", "error",
              "predicted samples / s", "measured samples / s", "error"]
    return _table("table-parity", header, rows)


def _classes_table(data: ReportData) -> str:
    classes = data.classes or {}
    names = [c for c in OP_CLASS_ORDER if c in classes] + sorted(c for c in classes if c not in OP_CLASS_ORDER)
    rows = [
        f'<tr data-label="{escape(n)}"><td>{escape(n)}</td>'
        + _num("flops_pct", classes[n]["flops_pct"], f"{classes[n]['flops_pct']:.1f}")
        + _num("time_pct", classes[n]["time_pct"], f"{classes[n]['time_pct']:.1f}") + "</tr>"
        for n in names
    ]
    out = _table("table-classes", ["operation class", "FLOPs (%)", "time (%)"], rows)
    if data.phases:
        phase_rows = [f'<tr data-label="{escape(k)}"><td>{escape(k)}</td>' + _num(k, v, f"{v * 1000:.1f}") + "</tr>"
                      for k, v in data.phases.items()]
        out += _table("table-phases", ["phase", "time (ms)"], phase_rows)
    return out


def _failed_table(results: list[RecipeResult]) -> str:
    rows = [
        f'<tr class="failed" data-label="{escape(r.label)}"><td>{escape(r.label)}</td><td>{escape(r.model)}</td>'
        f'<td data-key="status">{escape(r.status)}</td><td>{escape(r.reason or "(no reason recorded)")}</td></tr>'
        for r in results
    ]
    return _table("table-failed", ["recipe", "model", "status", "reason"], rows)
