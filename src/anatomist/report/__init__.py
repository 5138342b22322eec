"""`anatomist report`: one self-contained HTML file with the charts of estimate, plan, bench, profile.

Public entry point: `write_report(data_or_path, out_path, png_dir=None) -> Path`. The first
argument is an already-parsed JSON object (what `estimate`, `plan` and `bench --json` print),
a path to a file, or a list of them (their results are shown side by side).
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

from anatomist.errors import InputError
from anatomist.report import charts
from anatomist.report.about import subtitle
from anatomist.report.html import Chart, render_html
from anatomist.report.load import ReportData, comparable_peaks, load

__all__ = ["ReportData", "build_charts", "load", "write_report"]

PNG_DPI = 110
"""Sharp on a laptop screen while keeping a four-chart report near 300 KB."""


def build_charts(data: ReportData) -> list[Chart]:
    """Render every chart the input kinds call for; one that cannot be drawn carries the reason.

    A chart no input could feed (op classes without a profile, parity without bench results)
    is left out rather than shown as missing.
    """
    no_recipes = "No finished recipe in the input to draw."
    has_recipes = bool({"estimate", "plan", "bench"} & set(data.kinds))
    wanted = {"memory": has_recipes, "throughput": has_recipes, "parity": "bench" in data.kinds,
              "classes": "profile" in data.kinds}
    compared = [r for r in data.results if None not in comparable_peaks(r.predicted_memory, r.measured_memory)]
    specs = [
        ("memory", "Memory anatomy per recipe", data.ok_results, charts.memory_anatomy(data.results), no_recipes),
        ("throughput", "Throughput vs peak memory", data.ok_results, charts.throughput_vs_memory(data.results),
         "No throughput in the input: estimates without a time prediction and failed runs have none."),
        ("parity", "Predicted vs measured", compared, charts.predicted_vs_measured(data.results),
         "Nothing measured to compare with: parity needs bench results with both predicted and measured memory."),
        ("classes", "Operation classes: FLOPs vs time", [], charts.op_class_shares(data.classes, data.profile_device),
         "No operation classes: they come from `anatomist profile --json`."),
    ]
    out = []
    for key, title, results, fig, reason in specs:
        if not wanted[key]:
            continue
        if results:  # the alt text and heading say what the chart is about, as its subtitle does
            title = f"{title}: {subtitle(results)}"
        elif key == "classes" and data.profile_device:
            title = f"{title}: {data.profile_device}"
        png = None
        if fig is not None:
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=PNG_DPI)
            png = buf.getvalue()
        out.append(Chart(key=key, title=title, png=png, missing_reason=reason))
    return out


def write_report(data_or_path: Any, out_path: str | Path, png_dir: str | Path | None = None) -> Path:
    """Write the HTML report (and each chart as PNG into `png_dir`); return the HTML path.

    Raises:
        InputError: the input is missing, empty, corrupt or not an anatomist result, or the
            output cannot be written.
    """
    data = load(data_or_path)
    rendered = build_charts(data)
    out = Path(out_path)
    _write_atomic(out, render_html(data, rendered).encode("utf-8"))
    if png_dir is not None:
        directory = Path(png_dir)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create --png directory {directory}: {exc.strerror}") from None
        for chart in rendered:
            if chart.png:
                _write_atomic(directory / f"{chart.key}.png", chart.png)
    return out


def _write_atomic(path: Path, payload: bytes) -> None:
    """Write via a temporary file and rename, so an existing report is never left half-written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror}") from None
